"""examples/read_and_draw.py: one model (ViT + Llama + connector + UNet) reads and draws digits, trained jointly
by OmniTrainer from batches mixing both tasks. A short run at one process (fewer steps than the demo's, a lower
bar: both scores far above chance) with its per-module export loaded by each module's own class, and the same YAML
at 2 ranks (a few steps: every module trained, the export loading back)."""

import os

import read_and_draw
import torch
from diffusers import UNet2DConditionModel
from transformers import AutoModelForCausalLM

from hf_omni.testing.digits_omni import build_model

EXAMPLES = os.path.dirname(os.path.abspath(read_and_draw.__file__))
CONFIG = os.path.join(EXAMPLES, "configs", "read_and_draw.yaml")


def test_one_model_learns_to_read_and_to_draw(tmp_path):
    out = str(tmp_path / "out")
    result = read_and_draw.main([CONFIG, "--output_dir", out, "--max_steps", "400", "--per_digit", "3",
                                 "--disable_tqdm", "true"])  # 400 steps here: 95.6% and 93% (500: 96% and 100%)
    assert result["caption_accuracy"] >= 0.8, result  # chance: 10%
    assert result["drawing_score"] >= 0.6, result  # chance: 10%; at 300 steps 55%, at 200 18%
    assert os.path.isfile(os.path.join(out, "samples.png"))
    built = build_model(seed=0)  # the config's seed: where the run started
    llm = AutoModelForCausalLM.from_pretrained(os.path.join(out, "llm"))
    unet = UNet2DConditionModel.from_pretrained(os.path.join(out, "unet"))
    for module, start in ((llm, built.llm), (unet, built.unet)):
        trained = module.state_dict()
        assert any(not torch.equal(v, start.state_dict()[k]) for k, v in trained.items())


def test_the_same_yaml_runs_at_two_ranks(tmp_path, launch_ranks):
    """Every module trains (each rank its half of a global batch of 128), the export and samples are written."""
    out = tmp_path / "out"
    launch_ranks(os.path.join(EXAMPLES, "read_and_draw.py"), CONFIG, "--output_dir", str(out), "--max_steps", "4",
                 "--per_digit", "1", "--sampling_steps", "2", "--train_rows", "256", "--disable_tqdm", "true")
    built = build_model(seed=0)
    for name, cls in (("llm", AutoModelForCausalLM), ("unet", UNet2DConditionModel)):
        trained = cls.from_pretrained(out / name).state_dict()
        assert any(not torch.equal(v, getattr(built, name).state_dict()[k]) for k, v in trained.items()), name
    assert os.path.isfile(out / "samples.png") and os.path.isfile(out / "config.json")
