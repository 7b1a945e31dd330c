"""A diffusers pipeline on the (loopback) Hub: pushed as one repo in diffusers' layout, with its card; loaded back
by the pipeline class alone, by the composed model's `from_pretrained` and by `from_pipeline(Class, repo)` (eager
and `empty_init`); LoRA in diffusers' file for `load_lora_weights(repo)`; checkpoint-time pushes refused."""

import diffusers.loaders.lora_base
import diffusers.pipelines.pipeline_utils
import huggingface_hub
import pytest
import torch
import transformers
from diffusers import StableDiffusionPipeline
from diffusion_runs import SD, SDModel, model, trainer
from tiny_pipelines import sample, sd_pipeline

from hf_omni import OmniArgumentError
from hf_omni.testing.loopback_hub import LoopbackHub


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    cache = tmp_path_factory.mktemp("hf_cache")
    with LoopbackHub() as server, pytest.MonkeyPatch.context() as mp:
        for name, value in server.client_constants(str(cache)).items():
            mp.setattr(huggingface_hub.constants, name, value)
        mp.delenv("HF_TOKEN", raising=False)
        mp.setattr(transformers.utils.hub, "_hf_api", None)
        # diffusers' download asks huggingface_hub's module-level `model_info`, an HfApi made at import with the
        # endpoint of that time: the same call on an HfApi made now
        for module in (diffusers.pipelines.pipeline_utils, diffusers.loaders.lora_base):
            mp.setattr(module, "model_info", lambda *a, **k: huggingface_hub.HfApi().model_info(*a, **k))
        yield server


def test_a_pipeline_round_trips_through_the_hub(hub, tmp_path):
    lora = {**SD, "text_encoder": {"trainable": False}, "unet": {**SD["unet"], "learning_rate": 1e-2,
                           "lora": {"r": 4, "lora_alpha": 8, "init_lora_weights": "gaussian",
                                    "target_modules": ["to_q", "to_k", "to_v", "to_out.0"]}}}
    run = trainer("sd", str(tmp_path / "run"), lora, batch=4, max_steps=2, save_strategy="no", push_to_hub=True,
                  hub_model_id="org/sd", hub_strategy="end", report_to="none")
    run.train()
    live = sample(run.model.to_pipeline())
    commits = run.push_to_hub()
    assert list(commits) == ["org/sd"]
    files = set(huggingface_hub.HfApi().list_repo_files("org/sd"))
    assert {"model_index.json", "config.json", "README.md", "pytorch_lora_weights.safetensors",
            "unet/diffusion_pytorch_model.safetensors", "vae/config.json", "text_encoder/model.safetensors",
            "scheduler/scheduler_config.json", "tokenizer/tokenizer_config.json"} <= files
    card = huggingface_hub.hf_hub_download("org/sd", "README.md")
    assert "StableDiffusionPipeline.from_pretrained(\"org/sd\")" in open(card).read()
    assert torch.allclose(sample(StableDiffusionPipeline.from_pretrained("org/sd")), live, atol=1e-5)
    again = SDModel.from_pretrained("org/sd")
    assert sorted(again.pipeline_parts) == ["scheduler", "tokenizer"]
    assert torch.allclose(sample(again.to_pipeline()), live, atol=1e-5)
    adopted = SDModel.from_pipeline(StableDiffusionPipeline, "org/sd")
    assert torch.allclose(sample(adopted.to_pipeline()), live, atol=1e-5)
    empty = SDModel.from_pipeline(StableDiffusionPipeline, "org/sd", empty_init=True)
    assert all(p.is_meta for p in empty.unet.parameters())
    base = sd_pipeline()  # the base the run started from: only the UNet's adapters changed
    base.load_lora_weights("org/sd")
    assert torch.allclose(sample(base), live, atol=1e-4)


def test_checkpoint_pushes_and_per_module_repos_are_refused_before_compute(hub, tmp_path):
    for overrides, key in (({"hub_strategy": "every_save"}, "hub_strategy"), ({"hub_layout": "per_module",
                                                                                "hub_strategy": "end"}, "hub_layout")):
        with pytest.raises((OmniArgumentError, ValueError), match=key):
            trainer("sd", str(tmp_path / key), SD, batch=4, push_to_hub=True, hub_model_id="org/x",
                    report_to="none", **overrides)
    assert not huggingface_hub.HfApi().repo_exists("org/x") and model("sd") is not None
