"""fp16 with one GradScaler for every module (torch's CPU GradScaler; Accelerate's fp16 compute is a GPU path): an
inf in one module's gradients skips every module's step, the scale backs off once, and no module's scheduler steps
on the skipped step; the next finite step steps them all. The 2-rank case (an inf on one rank only) is in
tests/scripts/mp_step.py."""

import pytest
import torch
from accelerate import Accelerator
from helpers import tiny_data, tiny_model

from hf_omni import OmniPlugin

BATCH = 8


def prepared(schedule: str = "linear"):
    model = tiny_model()
    plugin = OmniPlugin(modules={"vision": {"trainable": False}},
                        defaults={"learning_rate": 1e-3, "lr_scheduler_type": schedule})
    accelerator = Accelerator(cpu=True)
    accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    model, optimizer, scheduler = plugin.prepare(accelerator, model, num_training_steps=4)
    batch = next(iter(torch.utils.data.DataLoader(tiny_data(model), batch_size=BATCH)))
    return model, plugin, accelerator.scaler, optimizer, scheduler, batch


def trained(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def one_step(model, plugin, scaler, optimizer, scheduler, batch, poison: str | None = None):
    scaler.scale(model(**batch).loss).backward()
    if poison is not None:  # one gradient element of one module overflows
        next(p for p in getattr(model, poison).parameters() if p.grad is not None).grad.view(-1)[0] = float("inf")
    plugin.clip_grad_norm_()
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad()


@pytest.mark.parametrize("poison", ["projector", "llm"])
def test_an_inf_in_one_module_skips_every_module_and_every_scheduler(poison):
    model, plugin, scaler, optimizer, scheduler, batch = prepared()
    before, rates = trained(model), scheduler.last_lr_by_module()
    epochs = {n: s.last_epoch for n, s in scheduler.schedulers.items()}
    one_step(model, plugin, scaler, optimizer, scheduler, batch, poison=poison)
    after = trained(model)
    assert all(torch.equal(before[n], after[n]) for n in before), [n for n in before if not torch.equal(before[n],
                                                                                                     after[n])]
    assert optimizer.stepped == set()
    assert scaler.get_scale() == 512.0
    assert scheduler.last_lr_by_module() == rates and {n: s.last_epoch for n, s in scheduler.schedulers.items()} == \
        epochs
    one_step(model, plugin, scaler, optimizer, scheduler, batch)  # finite: every module steps, every scheduler too
    stepped = trained(model)
    assert optimizer.stepped == {"projector", "llm"}
    assert all(not torch.equal(after[n], stepped[n]) for n in ("projector.proj.weight", "llm.lm_head.weight")
               if n in after)
    assert {n: s.last_epoch for n, s in scheduler.schedulers.items()} == {n: e + 1 for n, e in epochs.items()}
    assert scheduler.last_lr_by_module() != rates


def test_every_optimizer_is_handed_the_same_combined_answer():
    """What torch's scaler reads for each optimizer after hf_omni combined them: one tensor per optimizer, all with
    the sum of every module's found-inf (the poisoned module's alone would leave the other's at 0)."""
    from hf_omni.compat import scaler_state
    from hf_omni.optim.gradients import share_found_inf

    model, plugin, scaler, optimizer, scheduler, batch = prepared()
    scaler.scale(model(**batch).loss).backward()
    next(p for p in model.projector.parameters() if p.grad is not None).grad.view(-1)[0] = float("nan")
    optimizer.unscale_()
    mine = {n: sum(t.item() for t in scaler_state(scaler, o)["found_inf_per_device"].values()) for n, o in optimizer.optimizers.items()}
    assert mine == {"projector": 1.0, "llm": 0.0}, mine
    share_found_inf(scaler, list(optimizer.optimizers.values()))
    shared = [scaler_state(scaler, o)["found_inf_per_device"] for o in optimizer.optimizers.values()]
    assert [[t.item() for t in d.values()] for d in shared] == [[1.0], [1.0]]
    assert shared[0][torch.device("cpu")] is not shared[1][torch.device("cpu")]  # update() adds them in place


def test_fp16_through_accelerate_prepared_optimizer_is_refused_before_a_wrong_step():
    """`accelerator.prepare(optimizer)` under fp16: Accelerate's scaler unscales the composite, which would then
    unscale each module's optimizer again (gradients divided by the scale twice): refused, nothing stepped."""
    model, plugin, scaler, optimizer, scheduler, batch = prepared()
    from accelerate.optimizer import AcceleratedOptimizer

    wrapped = AcceleratedOptimizer(optimizer, scaler=scaler)
    before = trained(model)
    scaler.scale(model(**batch).loss).backward()
    with pytest.raises(RuntimeError, match="step the plugin's optimizer itself"):
        wrapped.step()
    assert all(torch.equal(before[n], p) for n, p in trained(model).items())


def test_a_step_where_no_module_has_gradients_updates_the_scale():
    """fp16, no gradient anywhere (a text-only batch with only the projector trained): every optimizer is handed a
    found-inf of 0, so torch's update() has its inf checks."""
    model, plugin, scaler, optimizer, scheduler, batch = prepared()
    scaler.scale(model(**batch).loss)  # no backward: no module has a gradient
    optimizer.step()
    assert optimizer.stepped == {"projector", "llm"} and scaler.get_scale() == 1024.0
