"""Expert parallelism on released MoE models adopted as they are (`from_model`): the experts layout looks through the
adopted module to the released model's own plan (`Layout.scoped`), as tensor parallelism does. Qwen2-MoE, Qwen3-MoE
and a DeepSeek-V3-style model at 2 ranks (`ep_size: 2`, one launch) against one process with the same global batch:
losses and weights within 1e-5, resume bitwise, the export loaded back by the released class."""

import pytest
import torch
from adopted_experts import FAMILIES, SINGLE, adopted, run
from helpers import assert_state_close
from launching import launch

ATOL = 1e-5


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("adopted_experts")
    launch("mp_adopted_experts.py", str(out))
    return {family: torch.load(out / f"{family}.pt", weights_only=False) | {"_dir": out / family}
            for family in FAMILIES}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_released_moe_spreads_its_experts_as_one_process(two_ranks, tmp_path, family):
    got = two_ranks[family]
    single = run(str(tmp_path / family), family, SINGLE, batch=8)
    strided = "(_StridedShard(dim=0, sf=2), Shard(dim=0))"  # FSDP2's rows nested inside ep's: the released plan's
    assert got["experts"] and set(got["experts"].values()) == {strided}, got["experts"]
    assert got["losses"] == pytest.approx(single["losses"], rel=ATOL, abs=ATOL)
    assert_state_close(got["state"], single["state"], ATOL)
    assert got["resumed_losses"] == got["losses"][-1:]
    assert all(torch.equal(got["resumed_state"][k], v) for k, v in got["state"].items())
    released = type(adopted(family).released).from_pretrained(two_ranks[family]["_dir"] / "export").state_dict()
    assert {f"llm.{k}" for k in released} == set(got["state"])
    assert all(torch.allclose(v, got["state"][f"llm.{k}"], atol=ATOL) for k, v in released.items())
