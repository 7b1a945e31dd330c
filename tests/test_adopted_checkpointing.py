"""`modules.<name>.activation_checkpointing` on an adopted model's module: the released class's own per-layer
checkpointing of the module's subtree. Training equals the run without it (LoRA and full), the layers really
recompute in backward, another module's layers are left alone, and a module with nothing to checkpoint is refused
before any compute."""

import types

import pytest
import torch
from helpers import make_args, step_losses
from released_models import BUILDERS, MODULES, Rows, collate

from hf_omni import OmniModel, OmniTrainer
from hf_omni.tuning.checkpointing import apply_activation_checkpointing

LORA = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]}


def run(tmp_path, llm: dict, steps: int = 3):
    model = OmniModel.from_model(BUILDERS["llava"](0), modules=MODULES["llava"])
    calls = []
    mlp = model.released.model.language_model.layers[0].mlp  # inside the checkpointed layer forward
    mlp.register_forward_pre_hook(lambda *_: calls.append(1))
    modules = {"vision": {"trainable": False}, "projector": {"learning_rate": 1e-2}, "llm": llm}
    trainer = OmniTrainer(model=model, args=make_args(tmp_path, modules=modules, max_steps=steps),
                          train_dataset=Rows("llava", model.released, 8 * steps), data_collator=collate)
    trainer.train()
    return model, step_losses(trainer), len(calls)


@pytest.mark.parametrize("llm", [{"lora": LORA, "learning_rate": 1e-2}, {"learning_rate": 1e-3}],
                         ids=["lora", "full"])
def test_checkpointing_an_adopted_llm_trains_as_without_it_and_recomputes_its_layers(tmp_path, llm):
    plain, plain_losses, plain_calls = run(tmp_path / "plain", llm)
    checked, losses, calls = run(tmp_path / "checked", {**llm, "activation_checkpointing": True})
    assert losses == pytest.approx(plain_losses, abs=1e-6)
    a, b = plain.state_dict(), checked.state_dict()
    assert a.keys() == b.keys() and max((a[k] - b[k]).abs().max().item() for k in a) <= 1e-6
    assert (plain_calls, calls) == (3, 6)  # each step's forward, and again in backward
    language = checked.released.model.language_model
    assert language.is_activation_checkpointing and not plain.released.model.language_model.is_activation_checkpointing
    assert not checked.released.model.vision_tower.is_activation_checkpointing


def test_a_carved_out_module_keeps_its_own_setting():
    """`llm` = LLaVA's `model` (a PreTrainedModel) less the vision tower and projector carved out of it: its
    checkpointing reaches its own layers, not the vision tower's."""
    model = OmniModel.from_model(BUILDERS["llava"](0), modules={
        "vision": "model.vision_tower", "projector": "model.multi_modal_projector", "llm": ["model", "lm_head"]})
    apply_activation_checkpointing(model.llm, types.SimpleNamespace(name="llm", activation_checkpointing_kwargs={}))
    released = model.released.model
    assert all(layer.gradient_checkpointing for layer in released.language_model.layers)
    assert not released.vision_tower.is_activation_checkpointing


def test_a_module_with_nothing_to_checkpoint_is_refused_before_any_compute(tmp_path):
    model = OmniModel.from_model(BUILDERS["llava"](0), modules=MODULES["llava"])
    forwards = []
    model.released.register_forward_pre_hook(lambda *_: forwards.append(1))
    modules = {"vision": {"trainable": False}, "projector": {"activation_checkpointing": True}}
    with pytest.raises(ValueError, match=r"^modules\.projector\.activation_checkpointing: none of its paths "
                                         r"\['model\.multi_modal_projector'\] is or holds a transformers model"):
        OmniTrainer(model=model, args=make_args(tmp_path, modules=modules),
                    train_dataset=Rows("llava", model.released, 8), data_collator=collate)
    assert not forwards
