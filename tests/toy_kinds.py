"""The runs of tests/test_toy_kinds.py (1 process) and tests/scripts/mp_toy_kinds.py (2 ranks): the toy layout
(`toy_layout.py`, `parallelism: {toy_size: 2}`) on the LLM, and the toy composition (`toy_composition.py`, a recipe
beside the modules) over the tiny captioner; each trained 4 steps saving every 2, resumed from step 2, exported,
exported again from its checkpoint by `hf-omni export`, and loaded back."""

from __future__ import annotations

import os

import torch
import toy_composition  # noqa: F401 (registers the `recipe` composition)
import toy_layout  # noqa: F401 (registers `parallelism.toy_size`)
from helpers import full_state, make_args, step_losses, tiny_data, tiny_model

from hf_omni import OmniTrainer
from hf_omni.files.composition import COMPOSITIONS
from hf_omni.testing.digits import Captioner

PREFIX = [3, 5]  # the recipe: token ids the composed forward prepends to every caption
LAYOUT = {"projector": {"learning_rate": 3e-3}, "llm": {"learning_rate": 1e-3, "parallel": "fsdp",
                                                        "parallelism": {"toy_size": 2}}}
RECIPE = {"projector": {"learning_rate": 3e-3}, "llm": {"learning_rate": 1e-3, "parallel": "fsdp"}}


class RecipeCaptioner(Captioner):
    """The tiny captioner reading its recipe: its prefix ids go before each row's caption (no loss on them)."""

    def forward(self, input_ids, pixel_values=None, image_features=None, labels=None, **kw):
        prefix = torch.tensor(self.recipe["prefix_ids"], device=input_ids.device).expand(input_ids.shape[0], -1)
        if labels is not None:
            labels = torch.cat([torch.full_like(prefix, -100), labels], dim=1)
        return super().forward(torch.cat([prefix, input_ids], dim=1), pixel_values, image_features, labels, **kw)


def layout_model():
    return tiny_model()


def recipe_model():
    tiny = tiny_model()
    return COMPOSITIONS["recipe"].compose(RecipeCaptioner, tiny.omni_modules(), tiny.processors,
                                          recipe={"prefix_ids": PREFIX})


def run(out: str, build, modules: dict, batch: int) -> dict:
    """4 steps saved every 2, the export; the same run resumed from step 2; `hf-omni export` of the last checkpoint.
    Every rank calls it; states are full tensors on every rank."""
    from hf_omni.cli import export

    common = dict(max_steps=4, per_device_train_batch_size=batch, modules=modules, save_strategy="steps",
                  save_steps=2)
    model = build()
    data = tiny_data(model, 32)
    trainer = OmniTrainer(model=model, args=make_args(os.path.join(out, "run"), **common), train_dataset=data)
    trainer.train()
    trainer.save_model(os.path.join(out, "export"))
    resumed = build()
    again = OmniTrainer(model=resumed, args=make_args(os.path.join(out, "resumed"), **common), train_dataset=data)
    again.train(resume_from_checkpoint=os.path.join(out, "run", "checkpoint-2"))
    if trainer.is_world_process_zero():
        export(os.path.join(out, "run", "checkpoint-4"), os.path.join(out, "exported"))
    return {"losses": step_losses(trainer), "state": full_state(model), "resumed_losses": step_losses(again)[-2:],
            "resumed_state": full_state(resumed), "wrapped": trainer.plugin.wrapped,
            "mesh": {n: tuple(m.mesh_dim_names) for n, m in trainer.plugin.meshes.items()},
            "placements": {n: str(p.placements) for n, p in model.llm.named_parameters() if hasattr(p, "placements")}}
