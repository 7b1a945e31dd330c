"""Crash safety: a child run killed with SIGKILL mid-step or mid-save resumes from the newest complete
checkpoint and reaches the uninterrupted run's final weights; rotation never removed that checkpoint."""

import os
import signal
import subprocess
import sys

import pytest
import torch
from checkpoint_scenario import make_trainer

from hf_omni.checkpoint_files import MARKER

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    trainer = make_trainer(tmp_path_factory.mktemp("straight"))
    trainer.train()
    return {k: v.clone() for k, v in trainer.model.state_dict().items()}


@pytest.mark.parametrize("mode,complete,partial", [("mid_step", "checkpoint-5", None),
                                                    ("mid_save", "checkpoint-5", "checkpoint-10")])
def test_killed_run_resumes_to_the_same_weights(tmp_path, straight, mode, complete, partial):
    child = subprocess.run([sys.executable, os.path.join(HERE, "scripts", "kill_run.py"), mode, str(tmp_path)],
                           capture_output=True, text=True, timeout=300)
    assert child.returncode == -signal.SIGKILL, child.stderr[-3000:]
    assert (tmp_path / complete / MARKER).exists()
    if partial:  # shards on disk, no marker: incomplete, and the complete one was not rotated away
        assert (tmp_path / partial / "llm" / "state").is_dir() and not (tmp_path / partial / MARKER).exists()
    resumed = make_trainer(tmp_path, seed=3)
    resumed.train(resume_from_checkpoint=True)
    assert resumed.state.global_step == 15
    for key, value in resumed.model.state_dict().items():
        assert torch.equal(value, straight[key]), key
    assert sorted(p.name for p in tmp_path.glob("checkpoint-*") if (p / MARKER).exists()) == ["checkpoint-15"]
