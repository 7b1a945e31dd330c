"""Single-process training: OmniTrainer and OmniPlugin against a hand-written reference loop."""

import math

import pytest
import torch
from accelerate import Accelerator
from helpers import assert_state_close, batches, clone, make_args, reference_train, step_losses, tiny_data, tiny_model
from peft import LoraConfig, inject_adapter_in_model
from transformers import get_scheduler

from hf_omni import OmniPlugin, OmniTrainer

MODULES = {
    "vision": {"trainable": False},
    "projector": {"learning_rate": 3e-3, "lr_scheduler_type": "cosine", "max_grad_norm": 0.05},
    "llm": {"learning_rate": 1e-3, "weight_decay": 0.1, "warmup_steps": 2, "max_grad_norm": 0.5},
}
REFERENCE = {
    "projector": {"lr": 3e-3, "scheduler": "cosine", "max_norm": 0.05},
    "llm": {"lr": 1e-3, "weight_decay": 0.1, "warmup": 2, "max_norm": 0.5},
}


def test_trainer_equals_reference_loop(tmp_path):
    model = tiny_model()
    data = tiny_data(model)
    reference = clone(model)
    trainer = OmniTrainer(model=model, args=make_args(tmp_path, max_steps=6, modules=MODULES), train_dataset=data)
    trainer.train()
    ref_losses = reference_train(reference, data, steps=6, batch_size=8, settings=REFERENCE)
    assert step_losses(trainer) == pytest.approx(ref_losses, abs=1e-6)
    assert_state_close(model.state_dict(), reference.state_dict(), atol=1e-6)
    # clipping was active (a test that would pass without clipping proves nothing)
    norms = [e["grad_norm/projector"] for e in trainer.state.log_history if "grad_norm/projector" in e]
    assert max(norms) > 0.05


def test_global_clip_scope_equals_reference(tmp_path):
    model = tiny_model()
    data = tiny_data(model)
    reference = clone(model)
    modules = {"vision": {"trainable": False}, "projector": {"learning_rate": 3e-3}}
    args = make_args(tmp_path, max_steps=4, learning_rate=1e-3, grad_clip_scope="global", max_grad_norm=0.3,
                     modules=modules)
    trainer = OmniTrainer(model=model, args=args, train_dataset=data)
    trainer.train()
    settings = {"projector": {"lr": 3e-3}, "llm": {"lr": 1e-3}}
    ref_losses = reference_train(reference, data, steps=4, batch_size=8, settings=settings, clip_scope="global",
                                 global_max_norm=0.3)
    assert step_losses(trainer) == pytest.approx(ref_losses, abs=1e-6)
    assert_state_close(model.state_dict(), reference.state_dict(), atol=1e-6)
    logs = [e for e in trainer.state.log_history if "grad_norm" in e]
    for entry in logs:  # combined norm = sqrt(sum of squared module norms)
        combined = math.sqrt(entry["grad_norm/projector"] ** 2 + entry["grad_norm/llm"] ** 2)
        assert entry["grad_norm"] == pytest.approx(combined, rel=1e-5)


def test_gradient_accumulation_equals_double_batch(tmp_path):
    model = tiny_model()
    data = tiny_data(model)
    other = clone(model)
    accumulated = OmniTrainer(model=model, args=make_args(tmp_path / "a", per_device_train_batch_size=4,
                                                          gradient_accumulation_steps=2, modules=MODULES),
                              train_dataset=data)
    accumulated.train()
    double = OmniTrainer(model=other, args=make_args(tmp_path / "b", per_device_train_batch_size=8, modules=MODULES),
                         train_dataset=data)
    double.train()
    assert step_losses(accumulated) == pytest.approx(step_losses(double), abs=1e-6)
    assert_state_close(model.state_dict(), other.state_dict(), atol=1e-6)


def test_frozen_module_unchanged_and_in_eval_mode(tmp_path):
    model = tiny_model(vision_dropout=0.5)  # dropout would change its output if it ran in train mode
    data = tiny_data(model)
    before = {k: v.clone() for k, v in model.vision.state_dict().items()}
    modes = []
    model.vision.register_forward_hook(lambda module, args, out: modes.append(module.training))
    trainer = OmniTrainer(model=model, args=make_args(tmp_path, modules=MODULES), train_dataset=data)
    trainer.train()
    assert modes and not any(modes)
    assert all(not m.training for m in model.vision.modules())
    assert all(not p.requires_grad for p in model.vision.parameters())
    for key, value in model.vision.state_dict().items():
        assert torch.equal(value, before[key]), key
    assert "vision" not in trainer.plugin.optimizer.optimizers
    assert set(trainer.plugin.optimizer.optimizers) == {"projector", "llm"}


def test_lora_trains_adapter_only(tmp_path):
    model = tiny_model()
    data = tiny_data(model)
    base_before = {k: v.clone() for k, v in model.llm.state_dict().items()}
    modules = {"vision": {"trainable": False},
               "llm": {"lora": {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]}}}
    trainer = OmniTrainer(model=model, args=make_args(tmp_path, learning_rate=1e-2, modules=modules),
                          train_dataset=data)
    trainer.train()
    state = model.llm.state_dict()
    lora_b = [k for k in state if "lora_B" in k]
    assert lora_b and all(state[k].abs().sum() > 0 for k in lora_b)  # B starts at zero: it trained
    for key, value in state.items():
        if "lora_" in key:
            continue
        assert torch.equal(value, base_before[key.replace(".base_layer.", ".")]), key
    trainable = {n for n, p in model.llm.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)


def test_top_level_lora_matching_nothing_leaves_module_frozen(tmp_path, caplog):
    model = tiny_model()
    data = tiny_data(model)
    before = {k: v.clone() for k, v in model.projector.state_dict().items()}
    args = make_args(tmp_path, lora={"r": 2, "target_modules": ["q_proj"]}, modules={"vision": {"trainable": False}})
    trainer = OmniTrainer(model=model, args=args, train_dataset=data)
    with caplog.at_level("INFO", logger="hf_omni.lora.inject"):
        trainer.train()
    assert "projector" in caplog.text and "fully frozen" in caplog.text
    assert trainer.plugin.trainable == ["llm"]
    assert not model.slots["projector"].trains  # what it ended as; its resolved arguments stay as written
    assert model.slots["projector"].args.trainable is True
    for key, value in model.projector.state_dict().items():
        assert torch.equal(value, before[key])


def test_each_module_follows_its_own_schedule(tmp_path):
    model = tiny_model()
    data = tiny_data(model)
    steps = 8
    modules = {"vision": {"trainable": False},
               "projector": {"learning_rate": 3e-3, "lr_scheduler_type": "cosine", "warmup_steps": 0.25},
               "llm": {"learning_rate": 1e-3, "lr_scheduler_type": "constant"}}
    trainer = OmniTrainer(model=model, args=make_args(tmp_path, max_steps=steps, learning_rate=5e-4, modules=modules),
                          train_dataset=data)
    trainer.train()
    logs = [e for e in trainer.state.log_history if "lr/projector" in e]
    assert len(logs) == steps

    def expected(name, lr, warmup):
        opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=lr)
        sched = get_scheduler(name, opt, num_warmup_steps=warmup, num_training_steps=steps)
        out = []
        for _ in range(steps):
            out.append(sched.get_last_lr()[0])
            opt.step()
            sched.step()
        return out

    assert [e["lr/projector"] for e in logs] == pytest.approx(expected("cosine", 3e-3, 2))
    assert [e["lr/llm"] for e in logs] == pytest.approx(expected("constant", 1e-3, 0))


def test_custom_accelerate_loop_equals_trainer(tmp_path):
    model = tiny_model()
    data = tiny_data(model)
    custom = clone(model)
    trainer = OmniTrainer(model=model, args=make_args(tmp_path, modules=MODULES), train_dataset=data)
    trainer.train()

    plugin = OmniPlugin(modules=MODULES, defaults={"optim": "adamw_torch"}, output_dir=str(tmp_path / "custom"))
    accelerator = Accelerator(cpu=True)
    custom, optimizer, scheduler = plugin.prepare(accelerator, custom, num_training_steps=4)
    losses = []
    for batch in batches(data, 8):
        if len(losses) == 4:
            break
        loss = custom(**batch).loss
        accelerator.backward(loss)
        plugin.clip_grad_norm_()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert losses == pytest.approx(step_losses(trainer), abs=1e-6)
    assert_state_close(custom.state_dict(), model.state_dict(), atol=1e-6)
    assert set(plugin.wrapped.values()) == {"none"}  # no process group: nothing is wrapped


def test_pre_frozen_parameters_are_respected_and_match_reference(tmp_path):
    """LoRA injected by the user before training: only the adapters train, exactly as in the reference loop."""
    model = tiny_model()
    torch.manual_seed(1)
    inject_adapter_in_model(LoraConfig(r=4, target_modules=["q_proj", "v_proj"]), model.llm)
    data = tiny_data(model)
    reference = clone(model)
    trainer = OmniTrainer(model=model, args=make_args(tmp_path, modules=MODULES), train_dataset=data)
    trainer.train()
    ref_losses = reference_train(reference, data, steps=4, batch_size=8, settings=REFERENCE)
    assert step_losses(trainer) == pytest.approx(ref_losses, abs=1e-6)
    assert_state_close(model.state_dict(), reference.state_dict(), atol=1e-6)


def test_activation_checkpointing_only_where_asked(tmp_path):
    model = tiny_model()
    data = tiny_data(model)
    reference = clone(model)
    modules = {**MODULES, "llm": {**MODULES["llm"], "activation_checkpointing": True}}
    trainer = OmniTrainer(model=model, args=make_args(tmp_path, modules=modules), train_dataset=data)
    trainer.train()
    assert model.llm.is_activation_checkpointing and not model.vision.is_activation_checkpointing
    ref_losses = reference_train(reference, data, steps=4, batch_size=8, settings=REFERENCE)
    assert step_losses(trainer) == pytest.approx(ref_losses, abs=1e-6)


def test_one_grad_scaler_shared_by_every_module():
    """fp16: each module's optimizer is unscaled once before clipping, steps through the one scaler, one update;
    an inf in any module's gradients skips every module's step (as one optimizer would)."""
    import copy

    from hf_omni.optim.gradients import clip_grad_norms
    from hf_omni.optim.optimizers import ModuleOptimizers

    torch.manual_seed(0)
    a, b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 2)
    ref_a, ref_b = copy.deepcopy(a), copy.deepcopy(b)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    opts = ModuleOptimizers({"a": torch.optim.SGD(a.parameters(), lr=0.1), "b": torch.optim.SGD(b.parameters(), lr=0.1)},
                            {"a": a, "b": b}, scaler)
    refs = [torch.optim.SGD(ref_a.parameters(), lr=0.1), torch.optim.SGD(ref_b.parameters(), lr=0.1)]
    x = torch.randn(3, 4)
    scaler.scale(b(a(x)).pow(2).sum()).backward()
    norms, _ = clip_grad_norms(opts, {"a": 0.5, "b": 0.5}, None)
    ref_b(ref_a(x)).pow(2).sum().backward()
    ref_norms = [torch.nn.utils.clip_grad_norm_(m.parameters(), 0.5) for m in (ref_a, ref_b)]
    assert [float(norms["a"]), float(norms["b"])] == pytest.approx([float(n) for n in ref_norms], rel=1e-6)
    assert max(ref_norms) > 0.5  # clipping was active
    opts.step()
    for opt in refs:
        opt.step()
    for mine, ref in ((a, ref_a), (b, ref_b)):
        for p, q in zip(mine.parameters(), ref.parameters()):
            assert torch.allclose(p, q, atol=1e-6)
    opts.zero_grad()
    scaler.scale(b(a(x)).pow(2).sum()).backward()
    a.weight.grad[0, 0] = float("inf")  # only module a overflows
    before = [p.detach().clone() for p in list(a.parameters()) + list(b.parameters())]
    clip_grad_norms(opts, {"a": 0.5, "b": 0.5}, None)
    opts.step()
    after = list(a.parameters()) + list(b.parameters())
    assert all(torch.equal(p, q) for p, q in zip(before, after))  # every module skipped
    assert scaler.get_scale() == 512.0  # one update, after the skip
