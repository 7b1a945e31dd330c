"""2 gloo ranks through `accelerate launch --multi_gpu --num_processes 2` (one launch runs every scenario)
against 1-rank runs of the same scenarios with the same global batch."""

import json
import os
import subprocess
import sys

import pytest
import torch
from helpers import assert_state_close, make_args, step_losses, tiny_data, tiny_model
from mp_scenarios import SCENARIOS, full_state_dict
from transformers import AutoModelForCausalLM

from hf_omni import OmniTrainer

HERE = os.path.dirname(os.path.abspath(__file__))


def launch_two_ranks(script: str, *args: str, timeout: int = 600) -> None:
    cmd = ["accelerate", "launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1",
           "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", "29531",
           os.path.join(HERE, "scripts", script), *args]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ACCELERATE_", "FSDP_"))}
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    if result.returncode != 0:
        sys.stderr.write(result.stdout[-6000:] + result.stderr[-12000:])
        raise AssertionError(f"{script} failed at 2 ranks (exit {result.returncode})")


@pytest.fixture(scope="module")
def two_rank_results(tmp_path_factory):
    out = tmp_path_factory.mktemp("two_ranks")
    launch_two_ranks("mp_train.py", str(out))
    return {name: torch.load(out / f"{name}.pt", weights_only=True) for name in SCENARIOS} | {"_dir": out}


def single_rank(tmp_path, name):
    model = tiny_model()
    trainer = OmniTrainer(model=model, args=make_args(tmp_path / name, **SCENARIOS[name]["single"]),
                          train_dataset=tiny_data(model))
    trainer.train()
    return step_losses(trainer), full_state_dict(model)


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_two_ranks_equal_one_rank(two_rank_results, tmp_path, name):
    losses, state = single_rank(tmp_path, name)
    got = two_rank_results[name]
    assert got["facts"]["world_size"] == 2
    assert got["losses"] == pytest.approx(losses, abs=1e-6)
    assert_state_close(got["state"], state, atol=1e-6)


def test_ddp_wraps_in_place_and_exports_original_classes(two_rank_results):
    facts = two_rank_results["ddp"]["facts"]
    assert facts["wrapped"] == {"vision": "none", "projector": "ddp", "llm": "ddp"}
    assert facts["classes"]["vision"] == "ViTModel"          # fully frozen: never wrapped
    assert facts["classes"]["llm"] == "DDPLlamaForCausalLM"  # composable replicate: a subclass, in place
    assert facts["llm_isinstance"]
    export = two_rank_results["_dir"] / "ddp" / "export"
    for module, cls in (("vision", "ViTModel"), ("projector", "Projector"), ("llm", "LlamaForCausalLM")):
        assert json.loads((export / module / "config.json").read_text())["architectures"] == [cls]
    root = json.loads((export / "config.json").read_text())
    assert {m["name"]: m["class"] for m in root["modules"]}["llm"] == "LlamaForCausalLM"
    assert AutoModelForCausalLM.from_pretrained(export / "llm").__class__.__name__ == "LlamaForCausalLM"
