"""Per-module checkpoints, single process: layout, exact resume, frozen sources, markers, rotation, bad input."""

import json
import os

import pytest
import torch
from helpers import Captioner, assert_state_close, make_args, step_losses, tiny_data, tiny_model
from transformers import AutoModelForCausalLM

from hf_omni import OmniTrainer
from hf_omni.checkpoint.marker import MARKER
from hf_omni.cli import export

MODULES = {
    "vision": {"trainable": False},
    "projector": {"learning_rate": 3e-3, "lr_scheduler_type": "cosine", "max_grad_norm": 0.05},
    "llm": {"learning_rate": 1e-3, "lora": {"r": 4, "target_modules": ["q_proj", "v_proj"]}, "warmup_steps": 2},
}


def run(tmp_path, steps=10, resume=None, model=None, **kw):
    model = model or tiny_model()
    args = make_args(tmp_path, max_steps=steps, save_strategy="steps", save_steps=5, modules=MODULES,
                     train_sampling_strategy="random", **kw)
    trainer = OmniTrainer(model=model, args=args, train_dataset=tiny_data(model, 48),
                          eval_dataset=tiny_data(model, 16) if kw.get("eval_strategy") else None)
    trainer.train(resume_from_checkpoint=resume)
    return trainer, model


def test_layout_and_each_module_folder_loads(tmp_path):
    trainer, model = run(tmp_path)
    ckpt = tmp_path / "checkpoint-5"
    assert (ckpt / MARKER).exists() and (ckpt / "trainer_state.json").exists() and (ckpt / "rng_state_0.json").exists()
    assert sorted(p.name for p in ckpt.iterdir() if p.is_dir()) == ["llm", "projector"]  # no frozen vision
    assert (ckpt / "llm" / "adapter_model.safetensors").exists() and (ckpt / "llm" / "state" / "scheduler.json").exists()
    marker = json.loads((ckpt / MARKER).read_text())
    assert marker["step"] == 5 and marker["modules"] == ["projector", "llm"] and marker["world_size"] == 1
    assert "projector/model.safetensors" in marker["files"] and "llm/adapter_model.safetensors" in marker["files"]
    base = tmp_path / "frozen" / marker["bases"]["llm"]["name"]  # the LoRA base: written once, beside the run
    assert "llm/model.safetensors" not in marker["files"] and (base / "model.safetensors").exists()
    root = json.loads((ckpt / "config.json").read_text())
    vision_source = {m["name"]: m["source"] for m in root["modules"]}["vision"]
    assert vision_source == str(tmp_path / "frozen" / "vision")  # built in memory: written once, then its source
    AutoModelForCausalLM.from_pretrained(ckpt / "llm")  # loadable as is
    assert Captioner.from_pretrained(ckpt) is not None


def test_resume_is_exact(tmp_path):
    straight, straight_model = run(tmp_path / "straight")
    first, _ = run(tmp_path / "split", steps=10)  # the same run, interrupted below by resuming from step 5
    os.remove(tmp_path / "split" / "checkpoint-10" / MARKER)  # pretend it died before step 10's save finished
    resumed, resumed_model = run(tmp_path / "split", resume=True, model=tiny_model(seed=1))  # other init weights
    assert resumed.state.global_step == 10
    assert step_losses(resumed) == step_losses(straight)  # 1-5 from the restored history, 6-10 rerun
    for key, value in straight_model.state_dict().items():
        assert torch.equal(value, resumed_model.state_dict()[key]), key


def test_frozen_module_reloads_from_its_source(tmp_path):
    run(tmp_path / "a")
    other = tiny_model(seed=7)  # a vision encoder with other weights: resume must restore the recorded source
    _, model = run(tmp_path / "a", resume=str(tmp_path / "a" / "checkpoint-5"), model=other)
    source = Captioner.from_pretrained(tmp_path / "a" / "checkpoint-5").vision.state_dict()
    for key, value in model.vision.state_dict().items():
        assert torch.equal(value, source[key]), key


def test_bad_resume_inputs_fail_before_anything(tmp_path):
    run(tmp_path)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        run(tmp_path, resume=str(tmp_path / "checkpoint-99"))
    os.remove(tmp_path / "checkpoint-5" / MARKER)
    with pytest.raises(ValueError, match="no hf_omni_checkpoint.json"):
        run(tmp_path, resume=str(tmp_path / "checkpoint-5"))
    shard = next((tmp_path / "checkpoint-10" / "llm" / "state").glob("*.safetensors"))
    shard.write_bytes(shard.read_bytes()[:10])
    with pytest.raises(ValueError, match="llm/state/.*has 10 bytes"):
        run(tmp_path, resume=str(tmp_path / "checkpoint-10"))
    with pytest.raises(ValueError, match="llm/state/.*has 10 bytes"):  # the newest with a marker: never skipped
        run(tmp_path, resume=True)
    with pytest.raises(ValueError, match="no complete checkpoint"):
        run(tmp_path / "empty", resume=True)


def test_resume_with_other_shapes_names_module_and_parameter(tmp_path):
    run(tmp_path)
    from hf_omni.testing.digits import build_model

    wider = build_model(hidden=32, layers=1, llm_hidden=48, llm_layers=1)
    with pytest.raises(ValueError, match=r"module 'projector'.*layers\.0\.weight"):
        run(tmp_path, resume=True, model=wider)
    changed = dict(MODULES, projector={"trainable": False})
    model = tiny_model()
    args = make_args(tmp_path, max_steps=10, save_strategy="steps", save_steps=5, modules=changed)
    with pytest.raises(ValueError, match=r"missing: \[\].*extra: \['projector'\]"):
        OmniTrainer(model=model, args=args, train_dataset=tiny_data(model, 48)).train(resume_from_checkpoint=True)


def test_rotation_counts_only_complete_checkpoints(tmp_path):
    run(tmp_path, steps=15, save_total_limit=2)
    assert sorted(p.name for p in tmp_path.glob("checkpoint-*")) == ["checkpoint-10", "checkpoint-15"]
    # an incomplete newer checkpoint is neither counted nor removed, and never picked for resume
    partial = tmp_path / "checkpoint-20"
    partial.mkdir()
    from hf_omni.checkpoint.contents import newest_complete_checkpoint, rotate

    assert newest_complete_checkpoint(str(tmp_path)) == str(tmp_path / "checkpoint-15")
    assert rotate(str(tmp_path), 1, best=str(tmp_path / "checkpoint-10")) == []  # newest and best both stay
    assert partial.exists()
    assert rotate(str(tmp_path), 1, busy=(str(tmp_path / "checkpoint-10"),)) == []  # being pushed to the Hub
    assert rotate(str(tmp_path), 1) == [str(tmp_path / "checkpoint-10")]


def test_export_equals_save_model(tmp_path):
    trainer, model = run(tmp_path)
    trainer.save_model(str(tmp_path / "final"))
    from hf_omni.cli import export

    export(str(tmp_path / "checkpoint-10"), str(tmp_path / "exported"))
    a, b = Captioner.from_pretrained(tmp_path / "final"), Captioner.from_pretrained(tmp_path / "exported")

    def saved(state):  # ViT's config does not record add_pooling_layer=False: a reload adds a random pooler
        return {k: v for k, v in state.items() if not k.startswith("vision.pooler.")}

    assert_state_close(saved(a.state_dict()), saved(b.state_dict()), atol=0)
    assert_state_close(saved(a.state_dict()), model.state_dict(), atol=0)
    with pytest.raises(FileExistsError):
        export(str(tmp_path / "checkpoint-10"), str(tmp_path / "exported"))


def test_async_save_marks_checkpoint_only_when_written(tmp_path):
    from transformers import TrainerCallback

    seen = {}

    class Probe(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 7:  # the loop went on after the step-5 save; its marker waits
                seen["marker_at_7"] = (tmp_path / "async" / "checkpoint-5" / MARKER).exists()

    model = tiny_model()
    args = make_args(tmp_path / "async", max_steps=10, save_strategy="steps", save_steps=5, modules=MODULES,
                     train_sampling_strategy="random", save_async=True)
    trainer = OmniTrainer(model=model, args=args, train_dataset=tiny_data(model, 48), callbacks=[Probe()])
    trainer.train()
    assert seen == {"marker_at_7": False}
    for step in (5, 10):  # the next save and the end of training finished them
        assert (tmp_path / "async" / f"checkpoint-{step}" / MARKER).exists()
    straight, straight_model = run(tmp_path / "sync")
    resumed, resumed_model = run(tmp_path / "async", resume=str(tmp_path / "async" / "checkpoint-5"),
                                 model=tiny_model(seed=2))
    for key, value in straight_model.state_dict().items():
        assert torch.equal(value, resumed_model.state_dict()[key]), key


def test_plugin_save_and_load_state_in_a_custom_loop(tmp_path):
    from accelerate import Accelerator
    from helpers import batches

    from hf_omni import OmniPlugin

    def prepared(seed, output_dir=str(tmp_path / "run")):
        plugin = OmniPlugin(modules=MODULES, defaults={"optim": "adamw_torch"}, output_dir=output_dir)
        model, optimizer, scheduler = plugin.prepare(Accelerator(cpu=True), tiny_model(seed=seed),
                                                     num_training_steps=10)
        return plugin, model, optimizer, scheduler

    plugin, model, optimizer, scheduler = prepared(0)
    data = tiny_data(model, 32)
    for batch in batches(data, 8):
        model(**batch).loss.backward()
        plugin.clip_grad_norm_()
        optimizer.step(), scheduler.step(), optimizer.zero_grad()
    optimizer.scaler = torch.amp.GradScaler("cpu", init_scale=512.0, growth_interval=7)  # fp16's, shared
    plugin.save_state(str(tmp_path / "ckpt"))
    assert (tmp_path / "ckpt" / MARKER).exists() and (tmp_path / "ckpt" / "config.json").exists()
    other, other_model, other_optimizer, other_scheduler = prepared(4)
    other_optimizer.scaler = torch.amp.GradScaler("cpu")
    other.load_state(str(tmp_path / "ckpt"))
    assert other_optimizer.scaler.get_scale() == 512.0 and other_optimizer.scaler.get_growth_interval() == 7
    assert_state_close(other_model.state_dict(), model.state_dict(), atol=0)
    assert other_scheduler.get_last_lr() == scheduler.get_last_lr()
    for name, opt in optimizer.optimizers.items():
        mine = opt.state_dict()["state"]
        theirs = other_optimizer.optimizers[name].state_dict()["state"]
        assert all(torch.equal(mine[i]["exp_avg"], theirs[i]["exp_avg"]) for i in mine)
    no_dir, *_ = prepared(0, output_dir=None)
    with pytest.raises(ValueError, match="module 'vision' is frozen and was built in memory"):
        no_dir.save_state(str(tmp_path / "elsewhere"))


def test_export_command_line(tmp_path):
    import subprocess
    import sys

    run(tmp_path)
    result = subprocess.run([sys.executable, "-m", "hf_omni.cli", "export", str(tmp_path / "checkpoint-10"),
                             str(tmp_path / "out")], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["config.json", "llm", "projector", "vision"]
    assert not (tmp_path / "out" / "llm" / "state").exists()
    bad = subprocess.run([sys.executable, "-m", "hf_omni.cli", "export", str(tmp_path / "nope"), str(tmp_path / "o")],
                         capture_output=True, text=True)
    assert bad.returncode != 0 and "does not exist" in bad.stderr


def test_resave_removes_the_old_marker_first(tmp_path):
    """A save into a folder that already holds a complete checkpoint makes it incomplete until it finishes."""
    from hf_omni.checkpoint import marker as checkpoint

    trainer, _ = run(tmp_path, steps=5)
    ckpt = str(tmp_path / "checkpoint-5")
    seen = {}
    original = checkpoint.write_marker

    def spy(directory, info):
        seen["before"] = os.path.exists(os.path.join(directory, MARKER))
        original(directory, info)

    checkpoint.write_marker = spy
    try:
        trainer.plugin.save_state(ckpt)
    finally:
        checkpoint.write_marker = original
    assert seen == {"before": False} and (tmp_path / "checkpoint-5" / MARKER).exists()


@pytest.mark.parametrize("save_only_model", [False, True])
def test_load_best_model_at_end_restores_every_module(tmp_path, save_only_model):
    """The best checkpoint (here the one with the highest eval loss, so not the last) is read back per module, also
    from weights-only checkpoints (`save_only_model`), as Trainer does."""
    trainer, model = run(tmp_path, steps=10, eval_strategy="steps", eval_steps=5, load_best_model_at_end=True,
                         metric_for_best_model="eval_loss", greater_is_better=True,
                         per_device_eval_batch_size=8, save_only_model=save_only_model)
    best = trainer.state.best_model_checkpoint
    assert best is not None and best.endswith("checkpoint-5"), best
    expected = Captioner.from_pretrained(best).state_dict()
    for key, value in model.state_dict().items():
        if not key.startswith("vision.pooler."):
            assert torch.equal(value, expected[key]), key


def test_save_only_model_writes_module_folders_without_state_and_is_not_resumable(tmp_path):
    trainer, model = run(tmp_path, save_only_model=True)
    ckpt = tmp_path / "checkpoint-10"
    marker = json.loads((ckpt / MARKER).read_text())
    assert marker["resumable"] is False and not (ckpt / "rng_state_0.json").exists()
    assert sorted(p.name for p in ckpt.iterdir() if p.is_dir()) == ["llm", "projector"]
    assert not (ckpt / "llm" / "state").exists() and not (ckpt / "projector" / "state").exists()
    loaded = Captioner.from_pretrained(ckpt).state_dict()  # the weights, loadable as is
    for key, value in model.state_dict().items():
        if not key.startswith("vision.pooler."):
            assert torch.equal(value, loaded[key]), key
    with pytest.raises(ValueError, match="saved with save_only_model.*cannot be resumed"):
        run(tmp_path, resume=str(ckpt))


def test_verify_checkpoint_catches_a_change_that_keeps_the_size(tmp_path):
    run(tmp_path / "plain", steps=5)
    run(tmp_path / "verified", steps=5, verify_checkpoint=True)
    ckpt = tmp_path / "verified" / "checkpoint-5"
    marker = json.loads((ckpt / MARKER).read_text())
    assert set(marker["sha256"]) == set(marker["files"]) and "llm/optimizer.json" not in marker["files"]
    shard = next((ckpt / "llm" / "state").glob("*.safetensors"))
    data = bytearray(shard.read_bytes())
    data[-5] ^= 0x40  # a flipped bit inside a tensor: same size, loads without complaint unless verified
    shard.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=r"file llm/state/shard-.*\.safetensors does not match its sha256"):
        run(tmp_path / "verified", steps=10, resume=str(ckpt), verify_checkpoint=True)
    with pytest.raises(ValueError, match="does not match its sha256"):  # an export checks what was recorded
        export(str(ckpt), str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()
    with pytest.raises(ValueError, match="has no sha256 of its files to verify"):
        run(tmp_path / "plain", steps=10, resume=str(tmp_path / "plain" / "checkpoint-5"), verify_checkpoint=True)


def test_one_element_optimizer_tensors_round_trip_through_the_json_exactly():
    """AdamW's `step` and the moments of a one-element parameter go to optimizer.json (not to one rank's shard):
    back with their dtype and shape, bit for bit; a larger tensor stays in the shards."""
    from hf_omni.checkpoint.state_json import like, split

    state = {"state": {"scale": {"step": torch.tensor(7.0), "exp_avg": torch.tensor([0.1234567], dtype=torch.float32),
                                 "exp_avg_sq": torch.tensor([3e-9], dtype=torch.bfloat16)},
                       "w": {"step": torch.tensor(7.0), "exp_avg": torch.randn(3, 2), "count": torch.tensor(2**60)}},
             "param_groups": [{"params": ["scale", "w"], "lr": 1e-3}]}
    tensors, rest = split(state, "here")
    assert set(tensors["scale"]) == set() and set(tensors["w"]) == {"exp_avg"}
    saved = json.loads(json.dumps(rest))  # as optimizer.json holds it
    for fqn, values in state["state"].items():
        for key, value in saved["state"][fqn].items():
            back = like(value, values[key])
            assert back.dtype == values[key].dtype and back.shape == values[key].shape
            assert torch.equal(back, values[key]), (fqn, key)
