"""An adopted model's `get_image_features` served from the offline cache (`modules.<m>.offline_encoder`): its
per-image outputs (Qwen2.5-VL's of different lengths, mixed resolutions here) cached and given back to the released
forward as `mm_encoder_outputs`; the run equals the online one. Caching is refused when the method runs a module that
is not cached with it (the projector, in both families)."""

from importlib.util import find_spec

import pytest
import torch
import transformers
from packaging.version import Version
from helpers import make_args, step_losses
from released_models import BUILDERS, Rows, collate

from hf_omni import OmniModel, OmniTrainer

CACHED = {"llava": {"vision": ["model.vision_tower", "model.multi_modal_projector"],
                    "llm": ["model.language_model", "lm_head"]},
          "qwen2_5_vl": {"vision": "model.visual", "llm": ["model.language_model", "lm_head"]}}  # merger inside
SETTINGS = {"vision": {"trainable": False, "offline_encoder": "get_image_features"},
            "llm": {"lora": {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]}, "learning_rate": 1e-2}}


def run(tmp_path, family: str, offline: bool, modules=CACHED, settings=SETTINGS, released=None, **overrides):
    model = OmniModel.from_model(released or BUILDERS[family](), modules=modules[family])
    rows = Rows(family, model.released, 24, text_only_every=5, wide_every=2)
    args = make_args(tmp_path / f"{family}-{offline}", modules=settings, offline_modules=["vision"] if offline else None,
                     offline_cache_dir=str(tmp_path / "cache"), per_device_train_batch_size=6, **overrides)
    trainer = OmniTrainer(model=model, args=args, train_dataset=rows, data_collator=collate)
    trainer.train()
    return trainer


@pytest.mark.parametrize("family", ["llava", "qwen2_5_vl"])
def test_cached_image_features_train_as_online(tmp_path, family):
    online, offline = run(tmp_path, family, False), run(tmp_path, family, True)
    assert offline.model.slots["vision"].kind == "offline"
    assert all(p.is_meta for p in offline.model.vision.parameters())  # never held while training
    assert step_losses(offline) == pytest.approx(step_losses(online), abs=1e-6)
    a, b = online.model.llm.state_dict(), offline.model.llm.state_dict()
    assert a.keys() == b.keys()
    for key in a:
        assert (a[key] - b[key]).abs().max().item() <= 1e-6, key
    if family == "qwen2_5_vl":  # the served rows: 4 or 8 tokens per image, as the tower gives them
        served = offline.train_dataset[1]["image_features"]
        assert [tuple(t.shape) for t in served] == [(8, 24)] and "pixel_values" not in offline.train_dataset[1]
        assert "image_grid_thw" in offline.train_dataset[1]  # kept: the forward's position ids need it


def test_a_released_model_loaded_with_from_pretrained_trains_with_its_tower_offline(tmp_path):
    """transformers 5.25+ (with `kernels`) kernelizes a `from_pretrained` model at every train() / eval() switch on
    its first parameter's device, which is the meta device once the tower is served offline: the model is set back to
    torch's layers before the tower moves, and trains as the same weights built in memory."""
    BUILDERS["llava"]().save_pretrained(tmp_path / "released")
    loaded = type(BUILDERS["llava"]()).from_pretrained(tmp_path / "released")
    kernelized = getattr(loaded, "use_kernels", False)  # True from transformers 5.25 with `kernels` installed
    offline = run(tmp_path / "loaded", "llava", True, released=loaded, max_steps=2)
    built = run(tmp_path / "built", "llava", True, max_steps=2)
    assert all(p.is_meta for p in offline.model.vision.parameters())
    assert getattr(loaded, "use_kernels", False) is False
    if find_spec("kernels") is not None and Version(transformers.__version__) >= Version("5.25"):
        assert kernelized  # the newest leg: the case the reset is for
    assert step_losses(offline) == pytest.approx(step_losses(built), abs=1e-6)


def test_caching_an_entry_point_that_runs_another_module_is_refused(tmp_path):
    modules = {"llava": {"vision": "model.vision_tower", "projector": "model.multi_modal_projector",
                         "llm": ["model.language_model", "lm_head"]}}
    settings = {**SETTINGS, "projector": {"trainable": False}}
    with pytest.raises(ValueError, match=r"get_image_features also runs \['projector: model.multi_modal_projector'\]"
                                         r": an adopted model's entry point can be cached only when everything it "
                                         r"runs is frozen and cached with it"):
        run(tmp_path, "llava", True, modules=modules, settings=settings)
    assert not (tmp_path / "cache" / "vision-train").exists()  # nothing written
