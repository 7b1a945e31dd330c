"""The training step at 2 gloo ranks, one launch (tests/scripts/mp_step.py): no host read of device memory from
hf_omni's own frames outside logging (missing modality, offline module, global clipping), and fp16's overflow on
one rank alone skipping every module on every rank; the missing-modality exchange of a loop's window
(`plugin.agree_window`) and of a `generate` call agreed once, not per forward."""

import json

import pytest
from launching import launch

SCENARIOS = ("online", "offline", "offload", "grouped", "fp16", "windows")


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("step")
    launch("mp_step.py", str(out), processes=2)
    return {name: [json.loads((out / f"{name}-rank{r}.json").read_text()) for r in (0, 1)] for name in SCENARIOS}


@pytest.mark.parametrize("scenario", ["online", "offline"])
def test_no_host_read_from_hf_omni_in_steps_with_a_missing_modality(results, scenario):
    for rank, facts in enumerate(results[scenario]):
        assert facts["steps"] == 6, (rank, facts)
        assert facts["host_reads"] == [], (rank, facts["host_reads"])
        assert facts["other_reads"] >= 5, facts  # armed: it saw Trainer's own per-step read (logging_nan_inf_filter)
    if scenario == "online":  # the exchange ran dummies: ranks lacked an image while another had one
        assert sum(facts["dummies"] for facts in results["online"]) >= 3


def test_the_counter_sees_fp16s_one_host_read_per_step(results):
    """The positive control: the same counter, in the same processes, finds hf_omni's one `.item()` per fp16 step."""
    for facts in results["fp16"]:
        assert [where.split(" ")[0].rsplit(":", 1)[0] for _, where in facts["host_reads"]] == ["hf_omni/optim/optimizers.py"] * 3


def test_an_overflow_on_one_rank_alone_skips_every_module_on_every_rank(results):
    trained = {"projector", "llm"}
    for rank, facts in enumerate(results["fp16"]):
        first, poisoned, after = facts["steps"]
        assert {n.split(".")[0] for n in first["changed"]} == trained and first["stepped"] == sorted(trained)
        assert poisoned["changed"] == [] and poisoned["stepped"] == [] and poisoned["schedulers_stepped"] == [], rank
        assert poisoned["scale"] == first["scale"] / 2, rank
        assert {n.split(".")[0] for n in after["changed"]} == trained and after["schedulers_stepped"] == sorted(trained)
        assert "modules.llm.fsdp_plugin.cpu_offload" in facts["offload_refused"], facts["offload_refused"]


def test_fp16_gathers_in_fp16_and_keeps_fp32_shards_and_gradients(results):
    """Under fp16 compute the FSDP LLM's parameters are all-gathered in fp16 (half the bytes of fp32), its gradients
    reduce-scattered in fp32 into fp32 shards: the scaler unscales fp32 gradients."""
    for facts in results["fp16"]:
        assert ["all_gather", "torch.float16"] in facts["collectives"], facts["collectives"]
        assert ["all_gather", "torch.float32"] not in facts["collectives"], facts["collectives"]
        assert ["reduce_scatter", "torch.float32"] in facts["collectives"], facts["collectives"]
        assert facts["shard"] == "torch.float32" and {s["grad"] for s in facts["steps"]} == {"torch.float32"}


def test_offloaded_module_clips_with_the_resident_ones_and_trains_the_same(results):
    """cpu_offload (CPU: unpinned host memory), global clipping across an offloaded and a resident module, built
    and with empty_init: the resident run's losses, norms and weights. (Where shards and buffers live is checked
    on a GPU by bench/gpu_check.py: on a CPU-only machine both are the CPU.)"""
    for facts in results["offload"]:
        assert facts["resident"]["norms"] and max(n[0] for n in facts["resident"]["norms"]) > 0.05  # clipping active
        for name in ("offloaded", "offloaded_empty_init"):
            run = facts[name]
            assert run["loss_diff"] <= 1e-6 and run["norm_diff"] <= 1e-6 and run["weight_diff"] <= 1e-6, (name, run)


def test_grouped_by_modality_every_step_agrees_on_its_modalities(results):
    """A forward that skips vision without an image (no entry point) at 2 ranks, vision sharded: each step's batches
    have images on both ranks or on neither, and both kinds of step happen."""
    first, second = (facts["seen"] for facts in results["grouped"])
    assert all(facts["steps"] == 8 for facts in results["grouped"])
    assert first == second and len(first) == 8 and set(first) == {True, False}, (first, second)


def test_grouped_by_modality_a_resume_in_epoch_1_serves_epoch_1s_order(results):
    for facts in results["grouped"]:
        straight, resumed = facts["resume"]["straight"], facts["resume"]["resumed"]
        assert sorted(straight) == sorted(resumed) == ["8", "9"] or sorted(straight) == sorted(resumed) == [8, 9]
        assert [resumed[k] for k in sorted(resumed)] == pytest.approx([straight[k] for k in sorted(straight)],
                                                                      abs=1e-6)


def test_a_plugin_window_and_a_generate_call_agree_their_exchange_once(results):
    """`plugin.agree_window` of 2 micro-batches: one side-group all-gather for both forwards (4 when each forward
    exchanges and its entry point agrees). `generate` of 6 tokens (no KV cache: every forward is given the image
    again on rank 0): the exchange and the entry point's agreement at the prefill and at the first decoding step,
    nothing at the 4 later tokens (12 when each forward exchanges)."""
    for facts in results["windows"]:
        assert facts["tokens"] == 6
        assert list(facts["window"].values()) == [1], facts["window"]
        assert list(facts["generate"].values()) == [4], facts["generate"]
