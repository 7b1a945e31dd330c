"""Fused MoE experts are never padded to a whole expert per rank (hf_omni/parallel/placement.py): FSDP2 shards a
parameter on dim 0 unless padding dim 0 over the shard group would add more than 5%, then on a dim that divides.

In process, torch's fake process group: one Mixtral-8x7B decoder layer on the meta device sharded as the last of 512
ranks would shard it (`hf_omni.testing.shard_padding`, the figures of bench/experts.py). At 2 gloo ranks (one launch,
tests/scripts/mp_experts.py) with the experts forced onto dim 1: `empty_init` reads, training, a bitwise resume, the
HF export, against one process; and a resume of that checkpoint in one process (elastic)."""

import os

import pytest
import torch
from helpers import assert_state_close, full_state, step_losses
from moe_runs import EXPERTS, trainer
from transformers import MixtralForCausalLM

from hf_omni.parallel.placement import placement_fn, shard_dim
from hf_omni.testing.shard_padding import dim0_placement, mixtral_layer, padding_figures

ATOL = 1e-5


def test_the_rule_keeps_dim0_unless_its_padding_exceeds_five_percent():
    assert shard_dim((8, 28672, 4096), 8) == 0  # one expert a rank
    assert shard_dim((8, 28672, 4096), 512) == 1  # 64 ranks an expert on dim 0
    assert shard_dim((8, 4096, 14336), 512) == 1
    assert shard_dim((8, 4096), 512) == 1  # the router
    assert shard_dim((32000, 4096), 512) == 0  # 0.8% padding
    assert shard_dim((4096,), 512) == 0  # a vector has no other dim
    assert shard_dim((8, 3, 1024), 512) == 2  # the first dim that divides
    assert shard_dim((8, 3, 5), 512) == 0  # none does: dim 0 still
    assert shard_dim((3, 16), 2) == 1 and shard_dim((21, 16), 2) == 0  # 33% / 4.8% padding


def test_mixtral_experts_at_512_ranks_gather_no_padding():
    figures = padding_figures(mixtral_layer, 512, placement_fn)
    experts = {n: t for n, t in figures["tensors"].items() if ".experts." in n}
    assert experts and all(t["dim"] == 1 for t in experts.values()), experts
    assert figures["ratio"] <= 1.05 and figures["worst"] <= 1.05, figures
    assert figures["idle_padding"] == 0
    dim0 = padding_figures(mixtral_layer, 512, dim0_placement)  # FSDP2's default, for the contrast
    assert dim0["worst"] == 64 and dim0["ratio"] > 60
    assert dim0["tensors"]["mlp.experts.gate_up_proj"]["idle"] == 28672 * 4096 * 4  # one fp32 expert, padding


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory, launch_ranks):
    out = tmp_path_factory.mktemp("experts")
    launch_ranks("mp_experts.py", str(out))
    everyone = torch.load(out / "experts.pt", weights_only=False)
    return everyone[0] | {"_dir": str(out), "_ranks": everyone}


@pytest.fixture(scope="module")
def one_process(two_ranks, tmp_path_factory):
    """The same 4 steps in one process (the same global batch), from the same folder."""
    run = trainer(two_ranks["_dir"], str(tmp_path_factory.mktemp("one")), batch=4, empty_init=False)
    run.train()
    return step_losses(run), full_state(run.model)


def test_experts_are_sharded_on_dim1_through_shard(two_ranks):
    assert two_ranks["world_size"] == 2
    placements = two_ranks["placements"]
    assert {placements[n] for n in EXPERTS} == {"(Shard(dim=1),)"}, placements
    assert {p for n, p in placements.items() if n not in EXPERTS} == {"(Shard(dim=0),)"}


def test_two_ranks_equal_one_process(two_ranks, one_process):
    losses, state = one_process
    assert two_ranks["losses"] == pytest.approx(losses, abs=ATOL)
    assert_state_close(two_ranks["state"], state, ATOL)
    ranks = two_ranks["_ranks"]
    assert all(torch.equal(ranks[1]["state"][k], v) for k, v in ranks[0]["state"].items())


def test_resume_at_two_ranks_is_bitwise(two_ranks):
    state, resumed = two_ranks["state"], two_ranks["resumed"]
    assert two_ranks["resumed_losses"][2:] == two_ranks["losses"][2:]
    assert resumed.keys() == state.keys()
    assert [k for k in state if not torch.equal(resumed[k], state[k])] == []


def test_resume_at_one_process_from_two_ranks(two_ranks, tmp_path):
    run = trainer(two_ranks["_dir"], str(tmp_path), batch=4, empty_init=False, seed=7)
    run.train(resume_from_checkpoint=os.path.join(two_ranks["_dir"], "straight", "checkpoint-2"))
    assert step_losses(run)[2:] == pytest.approx(two_ranks["losses"][2:], abs=ATOL)
    assert_state_close(full_state(run.model), two_ranks["state"], ATOL)


def test_export_loads_with_mixtrals_class(two_ranks, one_process):
    export = MixtralForCausalLM.from_pretrained(os.path.join(two_ranks["_dir"], "export", "llm")).state_dict()
    state = {k.removeprefix("llm."): v for k, v in two_ranks["state"].items()}
    assert export.keys() == state.keys()
    assert [k for k in state if not torch.equal(export[k], state[k])] == []
    assert_state_close({f"llm.{k}": v for k, v in export.items()}, one_process[1], ATOL)
