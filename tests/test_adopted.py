"""Released composite models adopted as they are (`OmniModel.from_model`), one process: the mapping's refusals,
training against a hand-written loop, LoRA + frozen vision + trained projector, and the export in the released
class's own format (loads with that class, same outputs, same `generate`)."""

import copy
import json
import os

import pytest
import torch
from helpers import make_args, step_losses
from released_models import BUILDERS, MODULES, Rows, collate
from safetensors import safe_open

from hf_omni import OmniModel, OmniTrainer
from hf_omni.lora.adapters import base_state_dict

FAMILIES = list(BUILDERS)
SETTINGS = {"vision": {"trainable": False}, "projector": {"learning_rate": 1e-2},
            "llm": {"lora": {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]}, "learning_rate": 1e-3}}


def settings(family: str) -> dict:
    """SETTINGS under the family's module names (BLIP-2's projector is its `qformer` module)."""
    return dict(zip(MODULES[family], SETTINGS.values()))


def adopted(family: str, seed: int = 0):
    model = BUILDERS[family](seed)
    return OmniModel.from_model(model, modules=MODULES[family])


def weight_keys(folder: str) -> set[str]:
    with safe_open(os.path.join(folder, "model.safetensors"), "pt") as f:
        return set(f.keys())


def test_every_tensor_belongs_to_exactly_one_module():
    with pytest.raises(ValueError, match=r"1 tensors of Qwen2_5_VLForConditionalGeneration belong to no module: "
                                         r"\['lm_head.weight'\]"):
        OmniModel.from_model(BUILDERS["qwen2_5_vl"](), modules={"vision": "model.visual",
                                                                "llm": "model.language_model"})
    with pytest.raises(ValueError, match=r"are one tensor \(tied weights\): put both paths in one module"):
        OmniModel.from_model(BUILDERS["paligemma"](), modules={
            "vision": "model.vision_tower", "projector": "model.multi_modal_projector",
            "llm": "model.language_model", "head": "lm_head"})
    with pytest.raises(ValueError, match="module 'vision': LlavaForConditionalGeneration has no submodule, "
                                         "parameter or buffer 'model.vision'"):
        OmniModel.from_model(BUILDERS["llava"](), modules={"vision": "model.vision", "rest": "model"})
    with pytest.raises(ValueError, match="module 'llm': 'model.language_model.norm' lies inside its own"):
        OmniModel.from_model(BUILDERS["llava"](), modules={"llm": ["model", "model.language_model.norm", "lm_head"]})
    with pytest.raises(ValueError, match="path 'lm_head' is given to modules 'a' and 'b'"):
        OmniModel.from_model(BUILDERS["llava"](), modules={"a": ["model", "lm_head"], "b": "lm_head"})


def test_carved_module_owns_its_subtree():
    model = adopted("qwen2_5_vl")
    projector = {n for n, _ in model.projector.named_parameters()}
    vision = {n for n, _ in model.vision.named_parameters()}
    assert projector and all(n.startswith("model.visual.merger.") for n in projector)
    assert not any(".merger." in n for n in vision)
    released = {n for n, _ in model.released.named_parameters()}
    llm = {n for n, _ in model.llm.named_parameters()}
    assert projector | vision | llm == released and len(projector) + len(vision) + len(llm) == len(released)


@pytest.mark.parametrize("family", ["llava", "qwen2_5_vl"])
def test_projector_training_equals_a_hand_written_loop(tmp_path, family):
    model = adopted(family)
    reference = copy.deepcopy(model)
    rows = Rows(family, model.released, 32)
    modules = {"vision": {"trainable": False}, "llm": {"trainable": False}, "projector": {"learning_rate": 1e-2}}
    trainer = OmniTrainer(model=model, args=make_args(tmp_path, modules=modules, lr_scheduler_type="constant",
                                                      max_grad_norm=0), train_dataset=rows, data_collator=collate)
    trainer.train()
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    reference.requires_grad_(False)
    params = list(reference.projector.parameters())
    for p in params:
        p.requires_grad_(True)
    optimizer = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.0)
    reference.released.train()
    reference.released.model.vision_tower.eval() if family == "llava" else None
    expected = []
    for start in range(0, 32, 8):  # plain PyTorch on the released model itself
        loss = reference.released(**collate([rows[i] for i in range(start, start + 8)])).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        expected.append(loss.item())
    assert losses == pytest.approx(expected, abs=1e-6)
    live, ref = model.released.state_dict(), reference.released.state_dict()
    assert max((live[k] - ref[k]).abs().max().item() for k in live) <= 1e-6


@pytest.mark.parametrize("family", FAMILIES)
def test_lora_llm_trained_projector_frozen_vision_export_in_released_format(tmp_path, family):
    model = adopted(family)
    cls = type(model.released)
    before = {k: v.clone() for k, v in model.released.state_dict().items()}
    rows = Rows(family, model.released, 32)
    trainer = OmniTrainer(model=model, args=make_args(tmp_path / "run", modules=settings(family)),
                          train_dataset=rows, data_collator=collate)
    trainer.train()
    assert {n: s.kind for n, s in model.slots.items()} == dict.fromkeys(MODULES[family], "none")
    after = base_state_dict(model.released.state_dict())  # LoRA's base_layer names folded back
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    bridge = [list(MODULES[family].values())[1]]
    bridge = [p for paths in bridge for p in ([paths] if isinstance(paths, str) else paths)]
    assert changed and all(any(k == p or k.startswith(p + ".") for p in bridge)
                           for k in changed)  # the base LLM and the vision tower are untouched
    assert any(".lora_B." in n and p.abs().sum() > 0 for n, p in model.llm.named_parameters())

    export = tmp_path / "export"
    trainer.save_model(str(export))
    fresh = tmp_path / "fresh"
    BUILDERS[family]().save_pretrained(fresh)
    assert weight_keys(export) == weight_keys(fresh)  # the released class's own keys (its save-time conversion)
    assert json.load(open(export / "config.json"))["architectures"] == [cls.__name__]
    recorded = json.load(open(export / "hf_omni.json"))
    assert recorded["adopted"] == {"class": cls.__name__}
    assert {m["name"]: m["paths"] for m in recorded["modules"]} == {
        k: [v] if isinstance(v, str) else v for k, v in MODULES[family].items()}

    batch = collate([rows[i] for i in range(4)])
    model.eval()
    with torch.no_grad():
        live = model(**batch).logits
        reloaded = cls.from_pretrained(export).eval()
        assert (reloaded(**batch).logits - live).abs().max().item() <= 1e-5
        again = OmniModel.from_pretrained(export)
        assert type(again).__name__ == "AdoptedModel" and again.module_names == list(MODULES[family])
        assert (again(**batch).logits - live).abs().max().item() <= 1e-5
        prompt = {k: v[:1] if k not in ("pixel_values", "image_grid_thw") else v for k, v in
                  collate([rows[0]]).items() if k != "labels"}
        kwargs = dict(max_new_tokens=4, do_sample=False, pad_token_id=0)
        assert torch.equal(model.generate(**prompt, **kwargs), reloaded.generate(**prompt, **kwargs))


def test_forward_keeps_the_released_signature_and_refuses_a_direct_call():
    model = adopted("llava")
    import inspect

    assert list(inspect.signature(model.forward).parameters)[:2] == ["input_ids", "pixel_values"]
    with pytest.raises(RuntimeError, match="module 'vision' of an adopted model is not called alone"):
        model.vision(torch.zeros(1))


@pytest.mark.parametrize("family", ["llava", "qwen2_5_vl"])
def test_resume_is_bitwise_and_the_checkpoint_exports_in_the_released_format(tmp_path, family):
    def trainer(out, seed=0):
        model = adopted(family)
        return OmniTrainer(model=model, args=make_args(out, modules=SETTINGS, save_strategy="steps", save_steps=2,
                                                       seed=seed),
                           train_dataset=Rows(family, model.released, 32), data_collator=collate)

    straight = trainer(tmp_path / "straight")
    straight.train()
    checkpoint = tmp_path / "straight" / "checkpoint-2"
    config = json.load(open(checkpoint / "config.json"))  # where the mapping is recorded: the root config
    assert [m["paths"] for m in config["modules"] if m["name"] == "projector"] == [[MODULES[family]["projector"]]]
    assert json.load(open(checkpoint / "projector" / "hf_omni_part.json"))["paths"] == [MODULES[family]["projector"]]
    released = tmp_path / "released"  # the module's files key its tensors as the released class's own save does
    BUILDERS[family](0).save_pretrained(released)
    projector_keys = weight_keys(checkpoint / "projector")
    assert len(projector_keys) == len(list(straight.model.projector.parameters()))
    assert projector_keys <= weight_keys(released)
    resumed = trainer(tmp_path / "resumed", seed=7)
    resumed.train(resume_from_checkpoint=str(checkpoint))
    a, b = straight.model.state_dict(), resumed.model.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

    from hf_omni.cli import main

    main(["export", str(tmp_path / "straight" / "checkpoint-4"), str(tmp_path / "export")])
    reloaded = type(straight.model.released).from_pretrained(tmp_path / "export").eval()
    batch = collate([straight.train_dataset[i] for i in range(4)])
    straight.model.eval()
    with torch.no_grad():
        assert (reloaded(**batch).logits - straight.model(**batch).logits).abs().max().item() <= 1e-5
    assert type(OmniModel.from_pretrained(tmp_path / "export")).__name__ == "AdoptedModel"


@pytest.mark.parametrize("family", FAMILIES)
def test_empty_init_builds_on_meta_and_trains_as_the_eager_build(tmp_path, family):
    """from_model(cls, folder, empty_init=True): nothing allocated until prepare, which reads the released files
    (through the class's own key conversion: LLaVA's files keep their legacy `language_model.model.*` keys); then
    training equals the eager `from_model(cls, folder)` exactly (LLM trained fully: a fresh LoRA is drawn apart)."""
    folder = tmp_path / "released"
    BUILDERS[family](0).save_pretrained(folder)
    cls = type(BUILDERS[family](0))
    modules = {**settings(family), "llm": {"learning_rate": 1e-3}}
    results = []
    for empty in (False, True):
        model = OmniModel.from_model(cls, str(folder), modules=MODULES[family], empty_init=empty)
        assert all(p.is_meta for p in model.parameters()) == empty
        trainer = OmniTrainer(model=model, args=make_args(tmp_path / str(empty), modules=modules),
                              train_dataset=Rows(family, model.released, 32), data_collator=collate)
        trainer.train()
        results.append((step_losses(trainer), model.state_dict()))
    (eager_losses, eager), (empty_losses, empty) = results
    assert empty_losses == eager_losses
    assert eager.keys() == empty.keys() and all(torch.equal(eager[k], empty[k]) for k in eager)


def test_empty_init_refusals(tmp_path):
    with pytest.raises(TypeError, match="takes no path and no empty_init"):
        OmniModel.from_model(BUILDERS["llava"](), modules=MODULES["llava"], empty_init=True)
    with pytest.raises(FileNotFoundError, match="has no config.json"):
        OmniModel.from_model(type(BUILDERS["llava"]()), str(tmp_path), modules=MODULES["llava"], empty_init=True)
    with pytest.raises(TypeError, match=r"takes no \['dtype'\]"):
        OmniModel.from_model(type(BUILDERS["llava"]()), str(tmp_path), modules=MODULES["llava"], empty_init=True,
                             dtype=torch.bfloat16)


def test_a_module_that_is_one_pretrained_model_gets_its_own_folder_on_request(tmp_path):
    """`save_pretrained(out, module_folders=[...])`: LLaVA's vision tower (a CLIPVisionModel) also as its own HF
    folder, loadable alone; a module of several paths, a carved one or a LoRA one is refused before writing."""
    from transformers import CLIPVisionModel

    model = adopted("llava")
    OmniTrainer(model=model, args=make_args(tmp_path / "run", modules={**SETTINGS, "vision": {"learning_rate": 1e-2}}),
                train_dataset=Rows("llava", model.released, 32), data_collator=collate).train()
    model.save_pretrained(tmp_path / "out", module_folders=["vision"])
    vision = CLIPVisionModel.from_pretrained(tmp_path / "out" / "vision")
    trained = model.released.model.vision_tower.state_dict()
    assert vision.state_dict().keys() == trained.keys()
    assert all(torch.equal(vision.state_dict()[k], trained[k]) for k in trained)
    assert not (tmp_path / "out" / "llm").exists()
    for name, why in (("llm", r"\['model.language_model', 'lm_head'\]\) is not one PreTrainedModel"),
                      ("projector", r"\['model.multi_modal_projector'\]\) is not one PreTrainedModel"),
                      ("nope", "is not a module")):
        with pytest.raises(ValueError, match=why):
            model.save_pretrained(tmp_path / "refused", module_folders=[name])
        assert not (tmp_path / "refused").exists()
    qwen = adopted("qwen2_5_vl")
    with pytest.raises(ValueError, match=r"module 'vision' \(\['model.visual'\]\) is not one PreTrainedModel with all"):
        qwen.save_pretrained(tmp_path / "refused", module_folders=["vision"])  # its merger carved out
