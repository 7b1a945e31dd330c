"""An async save writes the state as it was when `save_state` returned, though training goes on: buffers that a
forward changes (ResNet's BatchNorm statistics) are copied before it returns, parameters and optimizer state in the
background before the next optimizer step (which waits for them), and the files hold exactly the saved state."""

import torch
from accelerate import Accelerator
from real_models import Batches, build
from torch.utils.data import DataLoader

from hf_omni import OmniPlugin
from hf_omni.checkpoint import pipeline as save_pipeline

MODULES = {"resnet": {"learning_rate": 1e-2}, "projector": {"learning_rate": 1e-2},
           "llm": {"learning_rate": 1e-2, "lora": {"r": 2, "target_modules": ["q_proj", "v_proj"]}}}


def prepared(tmp_path, save_async, seed=0):
    plugin = OmniPlugin(modules=MODULES, defaults={"optim": "adamw_torch", "save_async": save_async},
                        output_dir=str(tmp_path / "run"))
    model, optimizer, scheduler = plugin.prepare(Accelerator(cpu=True), build(["resnet"], seed=seed),
                                                 num_training_steps=20)
    return plugin, model, optimizer, scheduler


def step(model, optimizer, scheduler, batch):
    model(**batch).loss.backward()
    optimizer.step(), scheduler.step(), optimizer.zero_grad()


def snapshot(model, optimizer):
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    moments = {name: {k: {n: t.clone() for n, t in s.items()} for k, s in opt.state_dict()["state"].items()}
               for name, opt in optimizer.optimizers.items()}
    return weights, moments


def test_async_save_holds_the_state_of_its_moment(tmp_path, monkeypatch):
    plugin, model, optimizer, scheduler = prepared(tmp_path, save_async=True)
    batches = list(DataLoader(Batches(24), batch_size=4))
    for batch in batches[:2]:
        step(model, optimizer, scheduler, batch)
    order = []
    release = __import__("threading").Event()
    copy = save_pipeline.copy_to_cpu

    def logged_copy(tensor, *args):  # the background copies wait until the loop reached its optimizer step
        if __import__("threading").current_thread().name.startswith("hf_omni_save"):
            release.wait()
            order.append("late copy")
        return copy(tensor, *args)

    monkeypatch.setattr(save_pipeline, "copy_to_cpu", logged_copy)
    fence = optimizer.before_step
    optimizer.before_step = lambda: (order.append("step"), release.set(), fence())
    saved = snapshot(model, optimizer)
    plugin.save_state(str(tmp_path / "ckpt"))
    order.append("save_state returned")
    for batch in batches[2:5]:  # forwards change the BatchNorm statistics; steps change parameters and moments
        step(model, optimizer, scheduler, batch)
    plugin.wait_for_save()
    assert order.index("save_state returned") < order.index("step") < order.index("late copy")
    first_step_done = len(order) - order[::-1].index("late copy")  # every late copy before the step went on
    assert "step" not in order[order.index("step") + 1:first_step_done]
    moved = snapshot(model, optimizer)
    assert not torch.equal(moved[0]["resnet.embedder.embedder.normalization.running_mean"],
                           saved[0]["resnet.embedder.embedder.normalization.running_mean"])

    other, other_model, other_optimizer, _ = prepared(tmp_path, save_async=False, seed=3)
    other.load_state(str(tmp_path / "ckpt"))
    weights, moments = snapshot(other_model, other_optimizer)
    for key, value in saved[0].items():
        assert torch.equal(weights[key], value), key
    for name, states in saved[1].items():
        for index, values in states.items():
            for key, value in values.items():
                assert torch.equal(moments[name][index][key], value), (name, index, key)


def test_after_a_failed_copy_no_write_runs():
    """Every rank learns that a copy failed (the agreement after the copies) and every rank skips every write: no
    rank enters a write's collectives alone."""
    import pytest

    pipeline = save_pipeline.SavePipeline()
    pipeline.begin([])
    pipeline._copies.append(lambda: 1 / 0)
    ran = []
    pipeline.then(lambda: ran.append("write"), "writing x")
    futures = pipeline.start()
    pipeline.fence()
    with pytest.raises(ZeroDivisionError):
        futures[0].result()
    with pytest.raises(save_pipeline.BackgroundWriteError, match="writing x: skipped, the copies of this save"):
        futures[1].result()
    assert ran == []
    pipeline.close()


def test_saving_before_any_step_leaves_the_optimizer_as_it_was(tmp_path):
    """torch initialises optimizer state for a save with a zero-lr step: the live optimizer must not keep it (its
    next step would count as the second)."""
    plugin, model, optimizer, scheduler = prepared(tmp_path, save_async=False)
    plugin.save_state(str(tmp_path / "ckpt"))
    assert all(len(opt.state) == 0 for opt in optimizer.optimizers.values())
    batch = next(iter(DataLoader(Batches(4), batch_size=4)))
    step(model, optimizer, scheduler, batch)
    steps = {float(s["step"]) for opt in optimizer.optimizers.values() for s in opt.state.values()}
    assert steps == {1.0}


def test_a_re_save_into_a_folder_drops_its_old_shards(tmp_path):
    """Shards left by an earlier save into the same folder (another world size, another file count) would be read
    back beside the new ones: a re-save starts from an empty state/."""
    import shutil

    plugin, model, optimizer, scheduler = prepared(tmp_path, save_async=False)
    batches = list(DataLoader(Batches(12), batch_size=4))
    step(model, optimizer, scheduler, batches[0])
    plugin.save_state(str(tmp_path / "old"))
    for batch in batches[1:]:
        step(model, optimizer, scheduler, batch)
    state = tmp_path / "ckpt" / "llm" / "state"
    state.mkdir(parents=True)
    for i, shard in enumerate(sorted((tmp_path / "old" / "llm" / "state").glob("*.safetensors"))):
        shutil.copy(shard, state / f"shard-00009-{i:05d}-of-00009.safetensors")  # sorts after the new ones
    plugin.save_state(str(tmp_path / "ckpt"))
    assert not list(state.glob("shard-00009-*"))
    saved = snapshot(model, optimizer)
    other, other_model, other_optimizer, _ = prepared(tmp_path, save_async=False, seed=3)
    other.load_state(str(tmp_path / "ckpt"))
    for name, states in saved[1].items():
        for index, values in states.items():
            for key, value in values.items():
                assert torch.equal(snapshot(other_model, other_optimizer)[1][name][index][key], value)


def test_async_copies_reuse_their_staging_buffers_and_hold_each_saves_values(tmp_path):
    """The parameters' host copies of an async save go into buffers kept from one save to the next (pinned when
    CUDA is there: the same path runs here without it), on the copy stream; each checkpoint's files still hold the
    values of its own moment, though the second save overwrote the buffers the first one wrote from."""
    from safetensors.torch import load_file

    plugin, model, optimizer, scheduler = prepared(tmp_path, save_async=True)
    batches = list(DataLoader(Batches(24), batch_size=4))
    pipeline, saved, buffers = plugin.checkpointer.pipeline, [], []
    for number, batch in enumerate(batches[:2]):
        step(model, optimizer, scheduler, batch)
        saved.append(model.projector.state_dict()["layers.0.weight"].clone())
        plugin.save_state(str(tmp_path / f"ckpt{number}"))
        plugin.wait_for_save()
        buffers.append({name: tensor.data_ptr() for name, tensor in pipeline.staging.buffers.items()})
    assert buffers[0] and buffers[0] == buffers[1] and any(name.startswith("projector/") for name in buffers[0])
    assert all(t.is_pinned() == torch.cuda.is_available() for t in pipeline.staging.buffers.values())
    assert pipeline.stream.cuda == torch.cuda.is_available()
    assert not torch.equal(saved[0], saved[1])
    for number in (0, 1):
        written = load_file(str(tmp_path / f"ckpt{number}" / "projector" / "model.safetensors"))
        assert torch.equal(written["layers.0.weight"], saved[number])
    plugin.close()
    assert pipeline.staging.buffers == {}
