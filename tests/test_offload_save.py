"""Saves and merged exports of an FSDP2 module with `cpu_offload` at 2 ranks (tests/scripts/mp_offload_save.py): a
Mixtral LLM (experts fused in memory, split on save: a derived group gathered on its writer) with LoRA.

- Every collective of the save, export and merge paths takes its tensors on the device the module's group serves
  (`shards.device.on_group_device`). On a CPU-only machine that device is the CPU, where offloaded shards live
  already; the script sets it to `meta` (standing for the accelerator under NCCL) and records what the first
  collective of each path received: the derived group's `dist.gather`, lora_A's `full_tensor`, a redistribution
  to rows. An unmoved CPU tensor (what NCCL refuses with "no backend type associated with device type cpu") fails
  here. The CUDA run is in bench/gpu_check.py.
- The merged export, moved there and back, equals PEFT's own merge of the gathered module.
- A derived group's conversion failing on rank 1 alone while rank 0 goes on to the next group's gathers: both
  ranks join every gather and raise the same RankFailure at once (instead of rank 1 waiting in the agreement while
  rank 0 waits in the gather)."""

import json

import pytest
from launching import launch


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("offload_save")
    launch("mp_offload_save.py", str(out), processes=2, timeout=240)
    return json.loads((out / "results.json").read_text())


def test_every_collective_of_save_export_and_merge_takes_the_groups_device(results):
    for rank, facts in enumerate(results):
        assert facts["offloaded"] == "cpu", facts
        assert facts["devices"] == {
            "save": {"seen": [["gather", "meta"]], "stopped": True},
            "merged": {"seen": [["all_gather_into_tensor", "meta"]], "stopped": True},
            "as_rows": {"seen": [["all_gather_into_tensor", "meta"]], "stopped": True}}, (rank, facts["devices"])


def test_an_offloaded_merged_export_equals_peft_merge(results):
    exports = results[0]["exports"]
    assert exports["keys_equal"] and exports["experts"] == 4 and exports["lora_b"] > 0, exports
    assert exports["max_diff"] == 0.0, exports


def test_a_conversion_failing_on_one_rank_fails_every_rank_at_once(results):
    raised = [facts["failure"]["raised"] for facts in results]
    assert raised[0] == raised[1] == ("RankFailure: module 'llm': writing " + raised[0].split("writing ")[1]), raised
    assert raised[0].endswith("/failed/llm failed on rank 1: RuntimeError: conversion failed here"), raised
    assert [facts["failure"]["conversions"] for facts in results] == [0, 1], results
    assert max(facts["failure"]["seconds"] for facts in results) < 30, results
