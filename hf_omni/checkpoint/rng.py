"""Each rank's RNG state in a checkpoint, as JSON (`rng_state_<rank>.json`: read back without unpickling).

Every rank restores its own file. Resuming at another world size, a rank that wrote none gets a deterministic
state derived from the saved ones and its rank (never rank 0's state on every rank), with a warning.
"""

from __future__ import annotations

import base64
import glob
import hashlib
import json
import os
import random
import warnings

import numpy as np
import torch


def _bytes(tensor: torch.Tensor) -> str:
    return base64.b64encode(tensor.numpy().tobytes()).decode()


def _tensor(text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8)


def rng_file(checkpoint: str, rank: int) -> str:
    return os.path.join(checkpoint, f"rng_state_{rank}.json")


def save_rng_state(checkpoint: str, rank: int) -> None:
    version, mt, gauss = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state()
    state = {"python": [version, list(mt), gauss], "numpy": [name, keys.tolist(), pos, has_gauss, cached],
             "cpu": _bytes(torch.random.get_rng_state())}
    if torch.cuda.is_available():
        state["cuda"] = _bytes(torch.cuda.random.get_rng_state())
    os.makedirs(checkpoint, exist_ok=True)
    with open(rng_file(checkpoint, rank), "w") as f:
        json.dump(state, f)


def _set(state: dict) -> None:
    version, mt, gauss = state["python"]
    random.setstate((version, tuple(mt), gauss))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.random.set_rng_state(_tensor(state["cpu"]))
    if torch.cuda.is_available() and "cuda" in state:
        torch.cuda.random.set_rng_state(_tensor(state["cuda"]))


def restore_rng_state(checkpoint: str, rank: int) -> None:
    """This rank's own state; at another world size, one derived from the saved ones."""
    mine = rng_file(checkpoint, rank)
    if os.path.isfile(mine):
        with open(mine) as f:
            _set(json.load(f))
        return
    saved = sorted(glob.glob(os.path.join(checkpoint, "rng_state_*.json")))
    if not saved:
        warnings.warn(f"rank {rank}: {checkpoint} has no RNG state; the random streams are not restored")
        return
    with open(saved[0]) as f:
        base = f.read().encode()
    seed = int(hashlib.sha256(base + rank.to_bytes(4, "little")).hexdigest()[:8], 16)
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    warnings.warn(f"rank {rank}: no RNG state of its own in {checkpoint} (saved at another world size); "
                  f"seeded it with {seed}, derived from {os.path.basename(saved[0])} and the rank")
