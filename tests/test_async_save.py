"""An async save writes the state as it was when `save_state` returned, though training goes on: buffers that a
forward changes (ResNet's BatchNorm statistics) are copied before it returns, parameters and optimizer state in the
background before the next optimizer step (which waits for them), and the files hold exactly the saved state."""

import torch
from accelerate import Accelerator
from real_models import Batches, build
from torch.utils.data import DataLoader

from hf_omni import OmniPlugin, save_pipeline

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

    def logged_copy(tensor):  # the background copies wait until the loop reached its optimizer step
        if __import__("threading").current_thread().name.startswith("hf_omni_save"):
            release.wait()
            order.append("late copy")
        return copy(tensor)

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
