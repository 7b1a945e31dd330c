"""Resume at 2 gloo ranks: bitwise at equal world size; 2 -> 1 and 1 -> 2 ranks within 1e-5, the global batch
kept (the per-device batch scaled)."""

import shutil

import pytest
import torch
from checkpoint_scenario import LAYOUTS, resume_trainer
from helpers import assert_state_close, full_state, step_losses


@pytest.fixture(scope="module")
def runs(tmp_path_factory, launch_ranks):
    root = tmp_path_factory.mktemp("resume")
    one_rank = root / "one_rank"
    for layout in LAYOUTS:  # 1 rank, global batch 8: its step-5 checkpoint is resumed at 2 ranks
        trainer = resume_trainer(one_rank / layout, layout, per_device=8)
        trainer.train()
        shutil.rmtree(one_rank / layout / "checkpoint-10")  # keep checkpoint-5 and frozen/ (vision's source)
    launch_ranks("mp_resume.py", str(root / "two"), str(one_rank))
    return root, torch.load(root / "two" / "resume.pt", weights_only=True)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_resume_at_equal_world_size_is_bitwise(runs, layout):
    (straight_losses, straight_state), (losses, state) = runs[1][layout]["straight"], runs[1][layout]["resumed"]
    assert losses == straight_losses
    assert_state_close(state, straight_state, atol=0)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_two_ranks_to_one(runs, tmp_path, layout):
    root, results = runs
    trainer = resume_trainer(root / "two" / layout / "split", layout, per_device=8, seed=5)
    trainer.train(resume_from_checkpoint=str(root / "two" / layout / "split" / "checkpoint-5"))
    straight_losses, straight_state = results[layout]["straight"]
    assert step_losses(trainer)[5:] == pytest.approx(straight_losses[5:], abs=1e-5)
    assert_state_close(full_state(trainer.model), straight_state, atol=1e-5)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_one_rank_to_two(runs, layout):
    results = runs[1][layout]
    grown_losses, grown_state = results["grown"]
    straight_losses, straight_state = results["straight"]
    assert grown_losses[5:] == pytest.approx(straight_losses[5:], abs=1e-5)
    assert_state_close(grown_state, straight_state, atol=1e-5)
