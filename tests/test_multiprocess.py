"""2 gloo ranks through `accelerate launch --multi_gpu --num_processes 2` (one launch runs every scenario)
against 1-rank runs of the same scenarios with the same global batch."""

import json

import helpers
import pytest
import torch
from helpers import assert_state_close, full_state, make_args, step_losses, tiny_data
from mp_scenarios import FSDP_ENV, SCENARIOS
from transformers import AutoModelForCausalLM

from hf_omni import OmniTrainer
from hf_omni.parallel.placement import shard_dim


@pytest.fixture(scope="module")
def two_rank_results(tmp_path_factory, launch_ranks):
    out = tmp_path_factory.mktemp("two_ranks")
    launch_ranks("mp_train.py", str(out))
    return {name: torch.load(out / f"{name}.pt", weights_only=True) for name in SCENARIOS} | {"_dir": out}


def single_rank(tmp_path, name):
    model = getattr(helpers, SCENARIOS[name]["model"])()
    trainer = OmniTrainer(model=model, args=make_args(tmp_path / name, **SCENARIOS[name]["single"]),
                          train_dataset=tiny_data(model))
    trainer.train()
    return step_losses(trainer), full_state(model)


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_two_ranks_equal_one_rank(two_rank_results, tmp_path, name):
    losses, state = single_rank(tmp_path, name)
    got = two_rank_results[name]
    assert got["facts"]["world_size"] == 2
    atol = SCENARIOS[name]["atol"]
    if SCENARIOS[name].get("offline"):  # trained from the cache: the vision encoder stayed on the meta device
        assert got["facts"]["wrapped"]["vision"] == "offline" and not any(k.startswith("vision.") for k in got["state"])
        hashes = got["facts"]["fingerprint_hashes"]  # rank 0 fingerprints the cache (weights, rows), rank 1 receives
        assert hashes[0] >= 2 and hashes[1] == 0, hashes
        state = {k: v for k, v in state.items() if not k.startswith("vision.")}
    assert got["losses"] == pytest.approx(losses, abs=atol)
    assert_state_close(got["state"], state, atol=atol)


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


def test_fsdp_module_beside_replicated_and_frozen(two_rank_results):
    facts = two_rank_results["fsdp"]["facts"]
    assert facts["wrapped"] == {"vision": "none", "projector": "ddp", "llm": "fsdp"}
    assert facts["classes"] == {"vision": "ViTModel", "projector": "DDPProjector", "llm": "FSDPLlamaForCausalLM"}
    assert facts["llm_isinstance"]
    assert list(facts["fsdp_plugins"]) == ["llm"]
    # decoder layers (the llm's _no_split_modules), the input embeddings and the root: 1 + 1 + 1 units
    assert facts["fsdp_units"]["llm"] == 3
    export = two_rank_results["_dir"] / "fsdp" / "export"
    assert json.loads((export / "llm" / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    assert (export / "llm" / "adapter_model.safetensors").exists()


@pytest.mark.parametrize("name", ["fsdp", "two_fsdp", "fsdp_model_scope", "fsdp_frozen_sharded"])
def test_sharded_parameter_bytes_are_half_per_rank(two_rank_results, name):
    facts = two_rank_results[name]["facts"]
    for module, kind in facts["wrapped"].items():
        local, full = facts["sharding"][module]["local_bytes"], facts["sharding"][module]["full_bytes"]
        if kind == "fsdp":  # dim-0 shards: at most one row per tensor above an even split
            assert full / 2 - 1 <= local <= full / 2 + 4096, (module, local, full)
        else:
            assert local == full, (module, local, full)


def test_two_fsdp_modules_keep_their_own_plugins_and_ignore_environment(two_rank_results):
    facts = two_rank_results["two_fsdp"]["facts"]
    plugins = facts["fsdp_plugins"]
    assert set(plugins) == {"vision", "llm"} and plugins["vision"]["id"] != plugins["llm"]["id"]
    assert plugins["vision"]["wrap"] == ["ViTLayer"] and plugins["llm"]["wrap"] == ["LlamaDecoderLayer"]
    assert plugins["vision"]["reshard"] is False and plugins["llm"]["reshard"] is True  # env said false
    assert "param_dtype=torch.bfloat16" in plugins["llm"]["mp"] and "param_dtype=None" in plugins["vision"]["mp"]
    assert all("reduce_dtype=torch.float32" in plugins[m]["mp"] for m in plugins)  # fp32 sums, bf16 or not
    assert facts["fsdp_units"] == {"vision": 3, "projector": 0, "llm": 3}
    assert facts["env"] == FSDP_ENV  # nothing read from the environment, nothing written to it


def test_model_scope_wraps_the_composed_model_once(two_rank_results):
    facts = two_rank_results["fsdp_model_scope"]["facts"]
    assert list(facts["fsdp_plugins"]) == ["(model)"]
    assert facts["model_class"] == "FSDPCaptioner"
    assert facts["wrapped"] == {"vision": "fsdp", "projector": "fsdp", "llm": "fsdp"}
    assert facts["fsdp_plugins"]["(model)"]["wrap"] == ["LlamaDecoderLayer", "ViTEmbeddings", "ViTLayer"]
    export = two_rank_results["_dir"] / "fsdp_model_scope" / "export"
    assert json.loads((export / "config.json").read_text())["omni_class"] == "Captioner"


def test_module_methods_called_outside_forward_under_fsdp(two_rank_results):
    """get_image_features (vision tower) and get_input_embeddings (llm) inside the composed forward."""
    facts = two_rank_results["fsdp_methods"]["facts"]
    assert facts["wrapped"]["vision"] == "fsdp" and facts["wrapped"]["llm"] == "fsdp"
    assert len(two_rank_results["fsdp_methods"]["losses"]) == 4


def test_accumulation_window_keeps_units_gathered_then_reshards(two_rank_results):
    """reshard_after_backward: false keeps the llm's layers gathered between micro-steps; resharded after the
    last one. The default reshards after every backward."""
    kept = two_rank_results["fsdp_accumulation"]["facts"]["gathered"]
    assert kept["in_window"] == [True] * 4 and kept["after_step"] == [False] * 4
    default = two_rank_results["fsdp_model_scope_accumulation"]["facts"]["gathered"]
    assert default["in_window"] == [False] * 4 and default["after_step"] == [False] * 4


def test_empty_init_reads_only_each_ranks_shards(two_rank_results):
    """empty_init: the FSDP llm is sharded on the meta device, then each rank reads only its own rows; the
    unwrapped modules are read in stripes of whole tensors (each rank its share, then broadcast). Training equals
    the eager single-rank run (test_two_ranks_equal_one_rank)."""
    facts = two_rank_results["fsdp_empty_init"]["facts"]
    assert facts["wrapped"]["llm"] == "fsdp"
    llm_reads = [r for r in facts["reads"] if r[0].startswith(("model.", "lm_head"))]
    other_reads = [r for r in facts["reads"] if not r[0].startswith(("model.", "lm_head", "base_model"))]
    assert llm_reads and other_reads
    for key, shape, full in llm_reads:  # half the rows; the 19-row embedding and LM head half their columns
        dim = shard_dim(full, 2)  # (hf_omni/parallel/placement.py: dim 0 would pad them 5.3%)
        assert dim == (1 if full[0] == 19 else 0), (key, full)
        half = [-(-n // 2) if d == dim else n for d, n in enumerate(full)]
        assert list(shape) == half, (key, shape, full)
    for key, shape, full in other_reads:
        assert shape == full, key


def test_frozen_module_sharded_only_when_its_entry_asks(two_rank_results):
    asked = two_rank_results["fsdp_frozen_sharded"]["facts"]
    assert asked["wrapped"]["vision"] == "fsdp" and asked["classes"]["vision"] == "FSDPViTModel"
    assert not asked["requires_grad"]["vision"] and asked["optimized"] == ["llm", "projector"]
    default = two_rank_results["fsdp"]["facts"]  # parallel: fsdp inherited from nowhere: a frozen module stays
    assert default["wrapped"]["vision"] == "none" and default["optimized"] == ["llm", "projector"]
