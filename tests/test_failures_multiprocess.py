"""A rank that fails alone never leaves the others waiting: at 2 ranks, under `accelerate launch` and as two plain
processes (RANK / WORLD_SIZE / MASTER_ADDR, no elastic agent, as `srun` starts them), rank 0 failing to write a
checkpoint (a full disk) and rank 1 failing to read one make every rank exit non-zero within 60 s with the same
error naming the failing rank, module and file; the newest complete checkpoint still resumes."""

import os
import subprocess
import sys
import time

import pytest
import torch
from checkpoint_scenario import make_trainer
from launching import SCRIPTS, free_port, subprocess_env

from hf_omni.checkpoint.contents import newest_complete_checkpoint
from hf_omni.checkpoint.marker import MARKER

SCRIPT = os.path.join(SCRIPTS, "mp_failures.py")


def under_accelerate(mode: str, out, port: int) -> list[int]:
    cmd = ["accelerate", "launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1", "--mixed_precision",
           "no", "--dynamo_backend", "no", "--main_process_port", str(port), SCRIPT, mode, str(out)]
    return [subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=subprocess_env()).returncode]


def as_plain_processes(mode: str, out, port: int) -> list[int]:
    procs = []
    for rank in (0, 1):
        env = subprocess_env(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2",
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        procs.append(subprocess.Popen([sys.executable, SCRIPT, mode, str(out)], env=env,
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    return [p.wait(timeout=120) for p in procs]


def errors(out) -> list[str]:
    return [(out / f"rank{r}.txt").read_text() for r in (0, 1)]


@pytest.mark.parametrize("launcher", [under_accelerate, as_plain_processes])
def test_a_rank_failing_alone_fails_every_rank_with_the_same_error(tmp_path, launcher):
    start = time.monotonic()
    codes = launcher("write", tmp_path, free_port())
    assert all(code != 0 for code in codes) and time.monotonic() - start < 60
    first, second = errors(tmp_path)
    assert first == second, (first, second)
    assert first.startswith("RankFailure: module 'projector': writing ") and "checkpoint-4/projector failed on rank 0" \
        in first and "No space left on device" in first and "model.safetensors" in first
    run = tmp_path / "run"
    assert newest_complete_checkpoint(str(run)) == str(run / "checkpoint-2")  # untouched
    assert not (run / "checkpoint-4" / MARKER).exists()
    if launcher is as_plain_processes:
        return
    for name in ("rank0.txt", "rank1.txt"):
        os.remove(tmp_path / name)
    codes = launcher("read", tmp_path, free_port())  # rank 1 cannot read what it resumes from
    assert all(code != 0 for code in codes)
    first, second = errors(tmp_path)
    assert first == second and "failed on rank 1" in first and "reading" in first and "model.safetensors" in first
    resumed = make_trainer(run, max_steps=6, save_steps=2, save_total_limit=None, per_device_train_batch_size=8,
                           gradient_accumulation_steps=1)
    resumed.train(resume_from_checkpoint=True)  # the newest complete checkpoint, at one process
    assert resumed.state.global_step == 6 and all(torch.isfinite(p).all() for p in resumed.model.parameters())


def test_an_async_write_failing_on_one_rank_fails_every_rank(tmp_path):
    """Rank 0's HF files fail in its background thread: the later writes (every rank's shards, whose collectives
    rank 1 waits in) still run, and both ranks raise the same error at the next save."""
    start = time.monotonic()
    codes = as_plain_processes("write_async", tmp_path, free_port())
    assert all(code != 0 for code in codes) and time.monotonic() - start < 60
    first, second = errors(tmp_path)
    assert first == second, (first, second)
    assert first.startswith("RankFailure: writing checkpoint ") and "checkpoint-4 failed on rank 0" in first
    assert "BackgroundWriteError: writing " in first and "checkpoint-4/projector: OSError" in first
    assert "No space left on device" in first and "model.safetensors" in first
    run = tmp_path / "run"
    assert newest_complete_checkpoint(str(run)) == str(run / "checkpoint-2")
    assert not (run / "checkpoint-4" / MARKER).exists()
