"""Each rank's RNG state on resume. Trainer writes `rng_state_<rank>.pth` (or `rng_state.pth` at world size 1)
and reads back only the name of the current world size; resuming at another world size, a rank restores the
file it wrote under the other name, or — when it wrote none — a deterministic state derived from the saved ones
(never rank 0's state on every rank)."""

from __future__ import annotations

import glob
import hashlib
import os
import random
import warnings

import numpy as np
import torch


def trainer_rng_file(checkpoint: str, rank: int, world: int) -> str:
    """The file Trainer itself reads for this rank at this world size."""
    return os.path.join(checkpoint, f"rng_state_{rank}.pth" if world > 1 else "rng_state.pth")


def _load(path: str) -> dict:
    from transformers.trainer_pt_utils import safe_globals

    with safe_globals():  # the file holds numpy's RNG state too
        return torch.load(path, weights_only=True)


def _set(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.random.set_rng_state(state["cpu"])
    if torch.cuda.is_available() and "cuda" in state:
        from transformers.trainer_pt_utils import set_rng_state_for_device

        set_rng_state_for_device("CUDA", torch.cuda, state, is_distributed=isinstance(state["cuda"], (list, tuple)))


def restore_other_world_size(checkpoint: str, rank: int) -> None:
    """For a rank whose Trainer file name is absent: its own file under the other name, else a derived seed."""
    mine = [f"rng_state_{rank}.pth"] + (["rng_state.pth"] if rank == 0 else [])
    found = next((os.path.join(checkpoint, f) for f in mine if os.path.isfile(os.path.join(checkpoint, f))), None)
    if found is not None:
        _set(_load(found))
        return
    saved = sorted(glob.glob(os.path.join(checkpoint, "rng_state*.pth")))
    if not saved:
        warnings.warn(f"rank {rank}: {checkpoint} has no RNG state; the random streams are not restored")
        return
    base = _load(saved[0])["cpu"].numpy().tobytes()
    seed = int(hashlib.sha256(base + rank.to_bytes(4, "little")).hexdigest()[:8], 16)
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    warnings.warn(f"rank {rank}: no RNG state of its own in {checkpoint} (saved at another world size); "
                  f"seeded it with {seed}, derived from {os.path.basename(saved[0])} and the rank")
