"""Who owns each tensor of an adopted model, one process: Gemma3's tied `lm_head` left out of the mapping is taken
into the LLM's module (and trains as when named, against a hand-written loop); BLIP-2's `query_tokens`, a parameter
of the root model, named as a path of the Q-Former's module (trained against a hand-written loop with LoRA on the
language model, checkpointed under its released name, resumed bitwise); the refusals of what cannot be owned.
The module matrix (export, `generate`, empty_init) runs BLIP-2 in test_adopted.py, 2 ranks in
test_adopted_multiprocess.py."""

import json
import logging
import os

import pytest
import torch
from helpers import make_args, step_losses
from peft import LoraConfig, inject_adapter_in_model
from released_models import MODULES, TIED_OUTSIDE, Rows, blip2, collate, gemma3
from safetensors import safe_open
from transformers import Gemma3ForConditionalGeneration, TrainerCallback

from hf_omni import OmniModel, OmniTrainer

LORA = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]}


def hand_loop(released, rows, groups: dict, steps: int = 4, batch: int = 8) -> list[float]:
    """Plain PyTorch on the released model: one AdamW per module ({name: (params, lr)}), each module's gradients
    clipped to norm 1 (Trainer's default `max_grad_norm`, per module)."""
    optimizers = {name: torch.optim.AdamW(params, lr=lr, weight_decay=0.0) for name, (params, lr) in groups.items()}
    losses = []
    for start in range(0, steps * batch, batch):
        loss = released(**collate([rows[i] for i in range(start, start + batch)])).loss
        loss.backward()
        for params, _ in groups.values():
            torch.nn.utils.clip_grad_norm_(params, 1.0)
        for optimizer in optimizers.values():
            optimizer.step()
            optimizer.zero_grad()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("mapping", ["outside", "inside"])
def test_a_tied_head_outside_every_module_is_taken_into_its_module(tmp_path, caplog, mapping):
    modules = TIED_OUTSIDE if mapping == "outside" else {**TIED_OUTSIDE, "llm": ["model.language_model", "lm_head"]}
    with caplog.at_level(logging.WARNING, logger="hf_omni.adopt.owners"):
        model = OmniModel.from_model(gemma3(), modules=modules)
    taken = [r for r in caplog.records if "taken into 'llm'" in r.getMessage()]
    assert len(taken) == (mapping == "outside") and (not taken or "'lm_head'" in taken[0].getMessage())
    assert model.llm.omni_paths == ["model.language_model", "lm_head"]
    settings = {"vision": {"trainable": False}, "projector": {"learning_rate": 1e-2}, "llm": {"learning_rate": 1e-3}}
    rows = Rows("gemma3", model.released, 32)
    args = make_args(tmp_path / "run", modules=settings, lr_scheduler_type="constant")
    trainer = OmniTrainer(model=model, args=args, train_dataset=rows, data_collator=collate)
    trainer.train()

    reference = gemma3()
    reference.train()
    reference.model.vision_tower.requires_grad_(False).eval()
    inner = reference.model  # the LLM's parameters hold the head's weight once: it is the embeddings' tensor
    expected = hand_loop(reference, rows, {"projector": (list(inner.multi_modal_projector.parameters()), 1e-2),
                                           "llm": (list(inner.language_model.parameters()), 1e-3)})
    assert step_losses(trainer) == pytest.approx(expected, abs=1e-6)
    live, ref = model.released.state_dict(), reference.state_dict()
    assert max((live[k] - ref[k]).abs().max().item() for k in ref) <= 1e-6
    assert model.released.lm_head.weight is model.released.model.language_model.embed_tokens.weight

    trainer.save_model(str(tmp_path / "export"))  # the mapping recorded with lm_head in llm: adopted back alike
    recorded = json.load(open(tmp_path / "export" / "hf_omni.json"))
    assert [m["paths"] for m in recorded["modules"] if m["name"] == "llm"] == [["model.language_model", "lm_head"]]
    again = OmniModel.from_pretrained(tmp_path / "export")
    assert again.llm.omni_paths == ["model.language_model", "lm_head"]
    reloaded = Gemma3ForConditionalGeneration.from_pretrained(tmp_path / "export")
    assert torch.equal(reloaded.lm_head.weight, model.released.lm_head.weight)


def test_a_tied_submodule_outside_is_refused_when_tied_to_several_modules_or_holding_untied_tensors():
    model = gemma3()
    model.extra = torch.nn.Module()  # tied to the projector and to the LLM
    model.extra.a = model.model.multi_modal_projector.mm_soft_emb_norm
    model.extra.b = torch.nn.Linear(16, 64, bias=False)
    model.extra.b.weight = model.model.language_model.embed_tokens.weight
    with pytest.raises(ValueError, match=r"'extra', outside every module, holds tied tensors \(extra.a.weight = "
                                         r"model.multi_modal_projector.*and is tied to modules \['llm', "
                                         r"'projector'\]: give 'extra'"):
        OmniModel.from_model(model, modules=TIED_OUTSIDE)
    model = gemma3()
    model.lm_head.bias = torch.nn.Parameter(torch.zeros(64))  # an untied tensor beside the tied weight
    with pytest.raises(ValueError, match=r"'lm_head', outside every module, holds tied tensors \(lm_head.weight = "
                                         r"model.language_model.embed_tokens.weight \(module 'llm'\)\) and also holds "
                                         r"untied tensors \['lm_head.bias'\]"):
        OmniModel.from_model(model, modules=TIED_OUTSIDE)


def test_a_path_that_names_something_else_says_what_it_names():
    good = MODULES["blip2"]
    cases = [
        ({**good, "qformer": ["qformer", "language_projection"]}, r"1 tensors of Blip2ForConditionalGeneration belong "
         r"to no module: \['query_tokens'\]\. Give each to a module in modules= by its path \('query_tokens': a "
         r"parameter\)"),
        ({**good, "qformer": ["qformer", "", "language_projection"]}, r"module 'qformer': '' names the whole "
         r"Blip2ForConditionalGeneration; name what the module holds instead \(the model holds submodules "
         r"\['vision_model', 'qformer', 'language_projection', 'language_model'\], parameters \['query_tokens'\]\)"),
        ({**good, "qformer": ["qformer", "query_token", "language_projection"]}, r"module 'qformer': Blip2For"
         r"ConditionalGeneration has no submodule, parameter or buffer 'query_token'; the model holds submodules"),
        ({**good, "qformer": ["qformer", "config", "language_projection", "query_tokens"]}, r"no submodule, "
         r"parameter or buffer 'config' \('config' is a Blip2Config attribute\)"),
        ({**good, "vision": ["vision_model", "qformer.layernorm.weight"]}, r"module 'vision': 'qformer.layernorm."
         r"weight' is a parameter of 'qformer.layernorm', inside module 'qformer''s path 'qformer'; .*give 'vision' "
         r"its submodule 'qformer.layernorm'"),
    ]
    for modules, message in cases:
        with pytest.raises(ValueError, match=message):
            OmniModel.from_model(blip2(), modules=modules)


class Snapshot(TrainerCallback):
    """The released model's tensors as training begins (the fresh LoRA adapters included)."""

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self.state = {k: v.detach().clone() for k, v in model.released.state_dict().items()}


def blip2_trainer(out, seed: int = 0, **overrides) -> OmniTrainer:
    model = OmniModel.from_model(blip2(), modules=MODULES["blip2"])
    settings = {"vision": {"trainable": False}, "qformer": {"learning_rate": 1e-2},
                "llm": {"lora": LORA, "learning_rate": 1e-3}}
    args = make_args(out, modules=settings, lr_scheduler_type="constant", seed=seed, **overrides)
    return OmniTrainer(model=model, args=args, train_dataset=Rows("blip2", model.released, 32), data_collator=collate)


def test_a_parameter_path_trains_as_a_hand_written_loop_and_resumes_bitwise(tmp_path):
    """BLIP-2: vision frozen; `query_tokens` (the root model's own parameter) trained with the Q-Former and the
    projection; LoRA on the OPT language model. A hand-written loop on a fresh BLIP-2 (the same adapters injected
    by PEFT, their initial values copied) agrees; the step-2 checkpoint holds `query_tokens` under its released name
    and resumes bitwise."""
    snapshot = Snapshot()
    trainer = blip2_trainer(tmp_path / "run", save_strategy="steps", save_steps=2)
    trainer.add_callback(snapshot)
    trainer.train()
    assert trainer.model.qformer.omni_paths == ["qformer", "query_tokens", "language_projection"]

    reference = blip2()
    inject_adapter_in_model(LoraConfig(**LORA), reference.language_model)
    reference.load_state_dict(snapshot.state)
    reference.requires_grad_(False)
    qformer = [reference.query_tokens, *reference.qformer.parameters(), *reference.language_projection.parameters()]
    lora = [p for n, p in reference.language_model.named_parameters() if ".lora_" in n]
    for p in qformer + lora:
        p.requires_grad_(True)
    reference.train()
    expected = hand_loop(reference, trainer.train_dataset, {"qformer": (qformer, 1e-2), "llm": (lora, 1e-3)})
    assert step_losses(trainer) == pytest.approx(expected, abs=1e-6)
    live, ref = trainer.model.released.state_dict(), reference.state_dict()
    assert live.keys() == ref.keys() and max((live[k] - ref[k]).abs().max().item() for k in ref) <= 1e-6
    assert not torch.equal(live["query_tokens"], snapshot.state["query_tokens"])

    checkpoint = tmp_path / "run" / "checkpoint-2"
    assert json.load(open(checkpoint / "qformer" / "hf_omni_part.json"))["paths"] == MODULES["blip2"]["qformer"]
    with safe_open(os.path.join(checkpoint, "qformer", "model.safetensors"), "pt") as f:
        assert "query_tokens" in set(f.keys())
    resumed = blip2_trainer(tmp_path / "resumed", seed=7)
    resumed.train(resume_from_checkpoint=str(checkpoint))
    a, b = trainer.model.state_dict(), resumed.model.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
