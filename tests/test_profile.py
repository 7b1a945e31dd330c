"""The per-module profile: `time/<module>` at logging steps against an independent timer, read only by `logs()`;
the bytes each module holds (`module_bytes`) against hand-computed numbers; the table logged once after prepare."""

import logging
import time

import pytest
import torch
from accelerate import Accelerator
from helpers import batches, make_args, tiny_data, tiny_model
from torch.utils.checkpoint import checkpoint
from transformers import TrainerCallback

from hf_omni import OmniPlugin, OmniTrainer
from hf_omni.metrics.module_bytes import predicted_optimizer_bytes
from hf_omni.metrics.profile import HostEvent, ModuleProfile, ModuleTimer
from hf_omni.testing.digits import Captioner
from hf_omni.testing.host_reads import HostReads

FROZEN_VISION = {"vision": {"trainable": False}}


@pytest.fixture(autouse=True)
def one_intra_op_thread():
    """On a shared CPU an intra-op thread pool waiting for a descheduled worker stalls for tens of milliseconds:
    real time, which the profile counts and the independent timers (around sleeps) cannot see."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


class SleepInBackward(torch.autograd.Function):
    """Identity whose backward sleeps `seconds`, adding the wall time of its backward to `timer.backward`."""

    @staticmethod
    def forward(ctx, x, seconds, timer):
        ctx.seconds, ctx.timer = seconds, timer
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        start = time.perf_counter()
        time.sleep(ctx.seconds)
        ctx.timer.backward.append(time.perf_counter() - start)
        return grad, None, None


class Timed:
    """Replaces `module.forward` by one that sleeps `forward_s` first and, where `backward_s`, sends its output
    through `SleepInBackward`; the wall time of every forward (also one cut short) goes to `forward`."""

    def __init__(self, module, forward_s: float, backward_s: float = 0.0):
        self.forward, self.backward = [], []
        inner = module.forward

        def timed_forward(*args, **kwargs):
            start = time.perf_counter()
            try:
                time.sleep(forward_s)
                out = inner(*args, **kwargs)
                if backward_s and hasattr(out, "last_hidden_state"):  # a ModelOutput
                    out.last_hidden_state = SleepInBackward.apply(out.last_hidden_state, backward_s, self)
                elif backward_s:
                    out = SleepInBackward.apply(out, backward_s, self)
                return out
            finally:
                self.forward.append(time.perf_counter() - start)

        module.forward = timed_forward

    def per_step(self, steps: range, calls_per_step: int = 1) -> float:
        """The independent figure for optimizer steps `steps` (0-based): mean forward + backward seconds per step."""
        fwd = self.forward[steps.start * calls_per_step:steps.stop * calls_per_step]
        bwd = self.backward[steps.start:steps.stop]
        return (sum(fwd) + sum(bwd)) / len(steps)


def logged(trainer) -> list[dict]:
    return [e for e in trainer.state.log_history if "loss" in e]


def assert_close_above(profiled: float, independent: float, what: str) -> None:
    """The profile's interval holds the timed one, plus little: hooks, the module's own small compute."""
    assert independent <= profiled <= independent * 1.15 + 0.003, f"{what}: {profiled:.4f} vs {independent:.4f}"


@pytest.mark.parametrize("vision_trains", [False, True])
def test_time_per_module_at_logging_steps_matches_an_independent_timer(tmp_path, vision_trains):
    """Frozen vision: forward only; the projector's inputs need no gradient (its backward ends with the pass).
    Trained vision: the projector's backward ends at its inputs' gradients, the vision tower's with the pass."""
    model = tiny_model()
    projector = Timed(model.projector, forward_s=0.02, backward_s=0.03)
    vision = Timed(model.vision, forward_s=0.01, backward_s=0.02 if vision_trains else 0.0)
    args = make_args(tmp_path, max_steps=4, logging_steps=2, modules={} if vision_trains else FROZEN_VISION)
    trainer = OmniTrainer(model=model, args=args, train_dataset=tiny_data(model))
    trainer.train()
    entries = logged(trainer)
    assert [e["step"] for e in entries] == [2, 4]
    for entry in trainer.state.log_history:
        assert any(k.startswith("time/") for k in entry) == ("loss" in entry), entry
    assert len(projector.forward) == len(projector.backward) == len(vision.forward) == 4
    assert len(vision.backward) == (4 if vision_trains else 0)
    for entry, steps in zip(entries, (range(1, 2), range(3, 4))):  # the logged steps alone are timed
        assert entry["time/llm"] > 0
        assert_close_above(entry["time/projector"], projector.per_step(steps), "projector")
        assert_close_above(entry["time/vision"], vision.per_step(steps), "vision")


class CheckpointedProjector(Captioner):
    """The projector under one activation checkpoint around the whole module: its forward runs again in backward."""

    def forward(self, input_ids, pixel_values=None, image_features=None, labels=None, **kw):
        feats = self.encode_image(pixel_values)
        prefix = checkpoint(self.projector, feats, use_reentrant=False)
        embeds = torch.cat([prefix, self.llm.get_input_embeddings()(input_ids)], dim=1)
        labels = torch.cat([labels.new_full(prefix.shape[:2], -100), labels], dim=1)
        return self.llm(inputs_embeds=embeds, labels=labels, **kw)


def test_recompute_counts_once_in_backward(tmp_path):
    """The recomputed forward is backward time, not a second forward (which would add another 40 ms a step)."""
    base = tiny_model()
    model = CheckpointedProjector.from_modules(base.omni_modules(), processors=base.processors)
    projector = Timed(model.projector, forward_s=0.04, backward_s=0.01)
    args = make_args(tmp_path, max_steps=2, logging_steps=2, modules=FROZEN_VISION)
    trainer = OmniTrainer(model=model, args=args, train_dataset=tiny_data(model))
    trainer.train()
    assert len(projector.forward) == 4  # each step: the forward and its recompute
    (entry,) = logged(trainer)
    assert_close_above(entry["time/projector"], projector.per_step(range(1, 2), calls_per_step=2), "projector")


def test_marks_are_read_only_by_logs_at_logging_steps(tmp_path, monkeypatch):
    """Every read of a timing mark (`elapsed_time`, `synchronize`) happens inside `ModuleProfile.logs`, which runs at
    logging steps only; and no hf_omni frame turns a tensor into a host value on any step (`HostReads`)."""
    reading, outside, inside, logs_calls = [False], [], [], []
    for method in ("elapsed_time", "synchronize"):
        original = getattr(HostEvent, method)

        def watched(self, *args, original=original, method=method):
            (inside if reading[0] else outside).append(method)
            return original(self, *args)

        monkeypatch.setattr(HostEvent, method, watched)
    original_logs = ModuleProfile.logs

    def watched_logs(self):
        reading[0] = True
        try:
            logs_calls.append(1)
            return original_logs(self)
        finally:
            reading[0] = False

    monkeypatch.setattr(ModuleProfile, "logs", watched_logs)
    model = tiny_model()
    args = make_args(tmp_path, max_steps=5, logging_steps=3, modules=FROZEN_VISION)
    trainer = OmniTrainer(model=model, args=args, train_dataset=tiny_data(model))
    with HostReads() as reads:
        trainer.train()
    assert len(logs_calls) == len(logged(trainer)) == 1  # step 3 only
    assert outside == []  # no mark read on any other step
    assert "synchronize" in inside and "elapsed_time" in inside
    assert reads.found == []
    assert reads.others > 0  # armed: Trainer's own reads were seen


class HooksPerStep(TrainerCallback):
    """How many times the profile's forward pre-hook ran in each optimizer step (Trainer's step numbers)."""

    def __init__(self, monkeypatch):
        self.calls, self.per_step = [0], {}
        original = ModuleTimer.before_forward

        def counted(timer, *args):
            self.calls[0] += 1
            return original(timer, *args)

        monkeypatch.setattr(ModuleTimer, "before_forward", counted)

    def on_step_end(self, args, state, control, **kwargs):
        self.per_step[state.global_step], self.calls[0] = self.calls[0], 0


def test_only_the_steps_that_end_in_a_log_run_the_hooks(tmp_path, monkeypatch):
    """Steps 1 (`logging_first_step`), 3 and 6 log: they alone run the profile's hooks (one forward of each of the
    three modules), every other step runs none; resumed at step 2, Trainer's own count decides (steps 3 and 6
    again, not the third and sixth of the resumed run); an own loop's plugin times its `logging_steps`."""
    count = HooksPerStep(monkeypatch)
    model = tiny_model()
    args = make_args(tmp_path, max_steps=6, logging_steps=3, logging_first_step=True, save_strategy="steps",
                     save_steps=2, modules=FROZEN_VISION)
    trainer = OmniTrainer(model=model, args=args, train_dataset=tiny_data(model, 48), callbacks=[count])
    trainer.train()
    assert count.per_step == {1: 3, 2: 0, 3: 3, 4: 0, 5: 0, 6: 3}
    assert [e["step"] for e in trainer.state.log_history if "time/projector" in e] == [1, 3, 6]
    count.per_step = {}
    resumed = OmniTrainer(model=tiny_model(), args=args, train_dataset=tiny_data(model, 48), callbacks=[count])
    resumed.train(resume_from_checkpoint=str(tmp_path / "checkpoint-2"))
    assert count.per_step == {3: 3, 4: 0, 5: 0, 6: 3}
    assert [e["step"] for e in resumed.state.log_history if "time/projector" in e and e["step"] > 2] == [3, 6]

    plugin = OmniPlugin(modules=FROZEN_VISION, defaults={"optim": "adamw_torch", "logging_steps": 2},
                        output_dir=str(tmp_path / "own"))
    own = tiny_model()
    _, optimizer, _ = plugin.prepare(Accelerator(cpu=True), own, num_training_steps=4)
    seen = []
    for batch in list(batches(tiny_data(own), 8))[:4]:
        own(**batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        seen.append(sorted(plugin.log_metrics()))
    assert [any(k.startswith("time/") for k in keys) for keys in seen] == [False, True, False, True]
    plugin.close()


def module_numbers(module) -> tuple[int, int]:
    """(bytes of its trainable parameters as held, how many trainable parameter tensors)."""
    params = [p for p in module.parameters() if p.requires_grad]
    return sum(p.numel() * p.element_size() for p in params), len(params)


def test_bytes_before_and_after_the_first_step_fp32_adamw(tmp_path):
    model = tiny_model()
    plugin = OmniPlugin(modules=FROZEN_VISION, defaults={"optim": "adamw_torch"}, output_dir=str(tmp_path))
    _, optimizer, _ = plugin.prepare(Accelerator(cpu=True), model, num_training_steps=2)
    p, n = module_numbers(model.llm)
    vision_bytes = sum(t.numel() * 4 for t in model.vision.parameters())
    before = plugin.module_bytes()
    assert before["llm"] == {"kind": "none", "mesh": "-", "parameters": p, "gradients": p, "optimizer": 2 * p + 4 * n,
                             "optimizer_basis": "predicted", "master": 0, "ema": 0, "total": 4 * p + 4 * n}
    assert before["vision"] == {"kind": "none", "mesh": "-", "parameters": vision_bytes, "gradients": 0,
                                "optimizer": 0, "optimizer_basis": "-", "master": 0, "ema": 0, "total": vision_bytes}
    batch = next(batches(tiny_data(model), 8))
    model(**batch).loss.backward()
    optimizer.step()
    after = plugin.module_bytes()
    assert after["llm"]["optimizer_basis"] == "held"
    assert {k: after["llm"][k] for k in ("gradients", "optimizer")} == {"gradients": p, "optimizer": 2 * p + 4 * n}
    held = sum(t.numel() * t.element_size() for s in optimizer.optimizers["llm"].state.values() for t in s.values())
    assert after["llm"]["optimizer"] == held
    assert after["projector"]["optimizer"] == 2 * module_numbers(model.projector)[0] + 4 * module_numbers(
        model.projector)[1]
    plugin.close()


def test_bf16_compute_counts_fp32_masters(tmp_path):
    """Under `bf16: true` the trained modules keep fp32 masters: `master` = their parameters' fp32 bytes, part of
    `parameters` (not added to `total`); the frozen module has none."""
    model = tiny_model()
    trainer = OmniTrainer(model=model, args=make_args(tmp_path, bf16=True, max_steps=1, modules=FROZEN_VISION),
                          train_dataset=tiny_data(model))
    trainer.train()
    rows = trainer.plugin.module_bytes()
    p, n = module_numbers(model.llm)
    assert {p_.dtype for p_ in model.llm.parameters()} == {torch.float32}
    assert rows["llm"]["master"] == p == rows["llm"]["parameters"]
    assert rows["llm"]["total"] == rows["llm"]["parameters"] + rows["llm"]["gradients"] + rows["llm"]["optimizer"]
    assert rows["vision"]["master"] == rows["vision"]["gradients"] == rows["vision"]["optimizer"] == 0


def test_bytes_without_lower_compute_has_no_master(tmp_path):
    model = tiny_model()
    trainer = OmniTrainer(model=model, args=make_args(tmp_path, max_steps=1, modules={
        "vision": {"trainable": False}, "llm": {"master_dtype": "float32"}}), train_dataset=tiny_data(model))
    trainer.train()
    assert trainer.plugin.module_bytes()["llm"]["master"] == 0  # fp32 masters, fp32 compute: no extra copy


@pytest.mark.parametrize("momentum, moments", [(0.9, 1), (0.0, 0)])
def test_sgd_prediction(momentum, moments):
    layer = torch.nn.Linear(4, 3)
    params = list(layer.parameters())
    optimizer = torch.optim.SGD(params, lr=0.1, momentum=momentum)
    assert predicted_optimizer_bytes(optimizer, params) == moments * (4 * 3 + 3) * 4
    layer(torch.ones(2, 4)).sum().backward()
    optimizer.step()
    held = sum(t.numel() * t.element_size() for s in optimizer.state.values() for t in s.values() if t is not None)
    assert held == moments * (4 * 3 + 3) * 4


def test_table_logged_once_after_prepare_and_hooks_removed_at_close(tmp_path, caplog):
    model = tiny_model()
    hooks_before = {name: (len(m._forward_pre_hooks), len(m._forward_hooks)) for name, m in
                    model.omni_modules().items()}
    trainer = OmniTrainer(model=model, args=make_args(tmp_path, max_steps=2, modules=FROZEN_VISION),
                          train_dataset=tiny_data(model))
    with caplog.at_level(logging.INFO, logger="hf_omni"):
        trainer.train()
    tables = [r.getMessage() for r in caplog.records if "bytes per rank by module" in r.getMessage()]
    assert len(tables) == 1
    rows = {line.split()[0]: line.split() for line in tables[0].splitlines()[2:5]}
    assert set(rows) == {"vision", "projector", "llm"}
    assert rows["projector"][6] == "predicted" and rows["vision"][6] == "-"
    p, n = module_numbers(model.llm)
    assert float(rows["llm"][-1]) == pytest.approx((4 * p + 4 * n) / 2**20, abs=0.006)
    # train() ends with plugin.close(): every hook of the profile removed, nothing recorded afterwards
    assert {name: (len(m._forward_pre_hooks), len(m._forward_hooks)) for name, m in
            model.omni_modules().items()} == hooks_before
    assert trainer.plugin.profile.logs() == {}


def test_evaluation_forwards_are_not_counted(tmp_path):
    """A forward while no trained module is in training mode (evaluation) is not recorded."""
    model = tiny_model()
    projector = Timed(model.projector, forward_s=0.05)
    plugin = OmniPlugin(modules=FROZEN_VISION, defaults={"optim": "adamw_torch", "logging_steps": 1},
                        output_dir=str(tmp_path))
    _, optimizer, _ = plugin.prepare(Accelerator(cpu=True), model, num_training_steps=2)
    batch = next(batches(tiny_data(model), 8))
    model.eval()
    with torch.no_grad():
        model(**batch)
    model.train()
    model(**batch).loss.backward()
    optimizer.step()
    logs = plugin.log_metrics()
    assert len(projector.forward) == 2
    assert projector.forward[1] <= logs["time/projector"] < projector.forward[0] + projector.forward[1]
    plugin.close()


def test_a_copy_of_a_profiled_module_is_not_timed(tmp_path):
    """`copy.deepcopy` of a prepared module (an EMA, a reference model) copies its hooks inert: the copy runs, its
    calls are recorded nowhere, and copying it copies no other module (the profile it was hooked to is not copied)."""
    import copy

    model = tiny_model()
    plugin = OmniPlugin(modules=FROZEN_VISION, defaults={"optim": "adamw_torch", "logging_steps": 1},
                        output_dir=str(tmp_path))
    _, optimizer, _ = plugin.prepare(Accelerator(cpu=True), model, num_training_steps=2)
    copied = {}
    twin = copy.deepcopy(model.projector, copied).train()
    assert not any(id(p) in copied for p in model.llm.parameters())
    twin(torch.ones(2, 3, 32, requires_grad=True)).sum().backward()
    assert plugin.profile.timers["projector"].calls == []
    batch = next(batches(tiny_data(model), 8))
    model(**batch).loss.backward()
    assert len(plugin.profile.timers["projector"].calls) == 1  # the original still is
    plugin.close()


def test_a_run_that_logs_rarely_holds_a_bounded_number_of_marks(tmp_path, monkeypatch):
    """Finished calls are folded into milliseconds after each step once a module holds more than FOLD_AFTER: the
    logged time is the same as when every mark is kept."""
    import hf_omni.metrics.profile as profile

    def run(fold_after: int, name: str):
        monkeypatch.setattr(profile, "FOLD_AFTER", fold_after)
        model = tiny_model()
        timed = Timed(model.projector, forward_s=0.01, backward_s=0.0)
        args = make_args(tmp_path / name, max_steps=-1, num_train_epochs=1, logging_strategy="epoch",  # every step
                         modules=FROZEN_VISION)  # timed: an epoch's last step is not known in advance
        trainer = OmniTrainer(model=model, args=args, train_dataset=tiny_data(model, 48))
        held = []
        original = profile.ModuleProfile.stepped

        def stepped(self, *a):
            original(self, *a)
            held.append(len(self.timers["projector"].calls))

        monkeypatch.setattr(profile.ModuleProfile, "stepped", stepped)
        trainer.train()
        return held, logged(trainer)[0]["time/projector"], timed.per_step(range(6), calls_per_step=1)

    held, folded, independent = run(1, "folded")
    assert max(held) <= 2 and held[-1] <= 2, held  # without folding: 1, 2, ..., 6
    assert_close_above(folded, independent, "projector")
    kept, whole, _ = run(10_000, "kept")
    assert kept == [1, 2, 3, 4, 5, 6]
