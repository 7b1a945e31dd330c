"""Crash safety: SIGKILL at 21 points of training (forward, backward, optimizer step), sync saving (each file kind, the
marker's temp file and rename), async saving (background copies, HF files, shards, before the marker) and rotation, then
`resume_from_checkpoint=True` (tests/scripts/kill_points.py, one process tree): every run resumes from the newest
complete checkpoint and ends with the uninterrupted run's weights, bitwise; every checkpoint with a marker passes
its checks (a marker never stands beside missing or partial files). A killed `hf-omni export` leaves no folder
that looks complete, and runs again."""

import os
import subprocess
import sys

import pytest
import torch
from launching import SCRIPTS, subprocess_env
from scripts.kill_points import POINTS


@pytest.fixture(scope="module")
def killed(tmp_path_factory):
    out = tmp_path_factory.mktemp("kill_points")
    result = subprocess.run([sys.executable, os.path.join(SCRIPTS, "kill_points.py"), str(out)],
                            capture_output=True, text=True, timeout=600, env=subprocess_env())
    assert result.returncode == 0, result.stderr[-4000:]
    return out, torch.load(out / "results.pt", weights_only=True), torch.load(out / "straight.pt", weights_only=True)


def test_there_are_at_least_twenty_points():
    assert len(POINTS) >= 20  # and the export below


@pytest.mark.parametrize("point", list(POINTS))
def test_killed_run_resumes_to_the_uninterrupted_weights(killed, point):
    out, results, straight = killed
    facts = results[point]
    assert facts["killed"] == -9, facts  # the point was reached
    assert facts["resume"] == 0 and facts["checked"] == facts["complete_after_kill"]
    if point not in ("frozen_source_first_save", "lora_base_before_marker"):
        assert facts["complete_after_kill"], facts  # resumed from a checkpoint, not restarted
    if point in ("marker_temp_file", "dcp_shards_written", "async_staging", "async_shards_in_flight",
                 "async_before_marker"):
        assert "checkpoint-10" not in facts["complete_after_kill"]  # files written, no marker: never picked
    resumed = torch.load(out / f"{point}.pt", weights_only=True)
    assert resumed["step"] == 15
    for key, value in straight.items():
        assert torch.equal(value, resumed["state"][key]), (point, key)


def test_killed_export_never_looks_complete_and_runs_again(killed):
    out, results, _ = killed
    facts = results["export"]
    assert facts["killed"] == -9 and not facts["out_exists"] and facts["partial_left"]
    assert facts["rerun"] == 0 and (out / "export" / "config.json").exists() and not (out / ".export.partial").exists()
