"""`hf-omni export` of a checkpoint whose modules set `export_ema`: their EMA weights, read from `state/`.

A checkpoint's module folder holds the live weights (what a resume needs); the EMA shadows are `ema.<param>` tensors
of its `state/` shards, and `state/ema.json` records `export`. In one process (no process group) the model is loaded
from the checkpoint, each such module's trained parameters are overwritten with its shadows (DCP gathers them whole
from every rank's shards), and the model is saved as `save_model()` would.
"""

from __future__ import annotations

import os

import torch

from ..files.module_folder import module_folder
from .module_state import STATE, load_module_tensors, read_ema_json, state_keys, state_metadata


def exports_ema(checkpoint: str, config) -> list[str]:
    """The modules of `checkpoint` saved with `export_ema`."""
    return [name for name in config.module_names
            if (read_ema_json(module_folder(checkpoint, config, name)) or {}).get("export")]


def fill_ema_weights(model, checkpoint: str, config) -> None:
    """Each `export_ema` module's trained parameters set to its EMA shadows (cast to the parameter's dtype)."""
    for name in exports_ema(checkpoint, config):
        folder = module_folder(checkpoint, config, name)
        params = dict(model.slots[name].module.named_parameters())
        metadata = state_metadata(folder)  # (read once, for both reads below)
        names = [k[len("ema."):] for k in state_keys(folder, metadata) if k.startswith("ema.")]
        missing = [n for n in names if n not in params]
        if missing:
            raise ValueError(f"module {name!r}: {os.path.join(folder, STATE)} holds EMA weights of {missing[:5]}, "
                             "which the module loaded from the checkpoint does not have")
        shadows = {n: torch.empty_like(params[n], dtype=torch.float32) for n in names}
        load_module_tensors(folder, {}, extra={"ema": shadows}, metadata=metadata)
        with torch.no_grad():
            for n, shadow in shadows.items():
                params[n].copy_(shadow)
