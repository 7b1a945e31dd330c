"""An entry point's inputs wrong on one rank (tests/scripts/mp_exchange.py, 2 plain processes, no launcher): the
error travels in the exchange's own all-gather, so both ranks raise the same error naming the module and the rank
within seconds, instead of one rank raising alone and the other waiting in a collective — inputs wrong in
forward's arguments (the exchange before forward), an entry point called unlike those arguments (its call's
agreement; inside an accumulation window, where the call has no agreement, at the window's next one, the failing rank
running the dummy meanwhile), a forward one rank cannot bind; an entry point with ragged
outputs (no dummy from one row) given inputs on one rank only: both raise the same error naming the fix."""

import os
import subprocess
import sys
import time

import pytest
from launching import SCRIPTS, free_port, subprocess_env

ON_RANK_1 = "(on rank 1; every rank raises this)"
CASES = {
    "partial": (r"ValueError: module 'vision': encode got ['pixel_values'] but None for ['mask']", ON_RANK_1),
    "not_a_tensor": ("ValueError: module 'vision': 'mask' of encode must be a tensor of 1 to 8 dims", ON_RANK_1),
    "not_as_planned": ("ValueError: module 'vision': encode was called on this rank with ['pixel_values'] of its "
                       "inputs ['pixel_values', 'mask'], unlike forward's arguments", ON_RANK_1),
    "unbound": ("ValueError: Tower.forward: got an unexpected keyword argument 'sound'", ON_RANK_1),
    "ragged": ("ValueError: module 'vision': encode returns ragged outputs", "serve the module from its offline cache"),
    "window_not_as_planned": ("ValueError: module 'vision': encode was called on this rank with ['pixel_values'] of "
                              "its inputs ['pixel_values', 'mask'], unlike forward's arguments",
                              "every rank raises this at the window's next agreement [after 1 steps]"),
    "window_then_save": ("RankFailure: saving ", "(on rank 1, inside an accumulation window) [after 1 steps]"),
}


@pytest.mark.parametrize("mode", list(CASES))
def test_one_rank_with_wrong_inputs_fails_every_rank_with_the_same_error(tmp_path, mode):
    port, procs, start = free_port(), [], time.monotonic()
    for rank in (0, 1):
        env = subprocess_env(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2",
                             MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        procs.append(subprocess.Popen([sys.executable, os.path.join(SCRIPTS, "mp_exchange.py"), mode, str(tmp_path)],
                                      env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True))
    codes = [p.wait(timeout=120) for p in procs]
    assert codes == [1, 1] and time.monotonic() - start < 60, [p.stderr.read()[-2000:] for p in procs]
    first, second = ((tmp_path / f"rank{r}.txt").read_text() for r in (0, 1))
    assert first == second, (first, second)
    assert first.startswith(CASES[mode][0]) and first.endswith(CASES[mode][1]), first
    if mode == "window_then_save":  # refused before anything of the checkpoint was written
        assert "failed on rank 1: ValueError: module 'vision': encode was called on this rank with" in first, first
        assert not (tmp_path / "checkpoint").exists()


def run_two(mode: str, out) -> list[str]:
    port, procs = free_port(), []
    for rank in (0, 1):
        env = subprocess_env(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2",
                             MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        procs.append(subprocess.Popen([sys.executable, os.path.join(SCRIPTS, "mp_exchange.py"), mode, str(out)],
                                      env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True))
    codes = [p.wait(timeout=120) for p in procs]
    assert codes == [0, 0], [p.stderr.read()[-2000:] for p in procs]
    return [(out / f"rank{r}.txt").read_text() for r in (0, 1)]


def test_a_ragged_entry_point_with_inputs_on_every_rank_runs(tmp_path):
    assert run_two("ragged_everywhere", tmp_path) == ["no error"] * 2


def test_two_towers_taking_forwards_arguments_exchange_once_per_forward(tmp_path):
    """Sound missing on rank 1 at the second step: its audio tower runs on a dummy, and each forward made one
    all-gather of metadata for both towers, then one agreement (one integer per rank) at each tower's call: 3 in
    all (the donor's row is a broadcast)."""
    first, second = (text.splitlines() for text in run_two("two_towers", tmp_path))
    assert first[0] == second[0] and first[0].startswith("gathers [3, 3, 3] grads"), (first, second)
    # ddp: every buffer rank 0's once wrapped; before each forward only the state (BatchNorm's statistics)
    assert (first[1], second[1]) == ("derived [0.0, 0.0] then [5.0, 5.0]", "derived [0.0, 0.0] then [6.0, 6.0]")
