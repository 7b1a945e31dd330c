"""How modules are wrapped: one strategy per file (`none.py`, `ddp.py`, `fsdp.py`) and the ordered driver
(`driver.py`) that applies them. Per-module device meshes belong here."""

from __future__ import annotations

import torch
from torch import nn

from . import fsdp


def full_state_dict(module: nn.Module) -> dict[str, torch.Tensor]:
    """The module's full state dict whatever its strategy. A sharded module is gathered (every rank must call
    this) and only rank 0 gets the tensors; other ranks get `{}`."""
    return fsdp.full_state_dict(module) if fsdp.is_sharded(module) else module.state_dict()
