"""`parallel: ddp`: data parallel in place with torch's composable `replicate` (DDP's bucketed all-reduce, no
wrapper object: `model.llm` keeps its class, as a generated `DDP...` subclass, and its methods)."""

from __future__ import annotations

import torch
from torch import nn

from ..compat import composable_replicate


def apply(module: nn.Module, device: torch.device, ddp_kwargs: dict) -> nn.Module:
    """Replicate `module` over all ranks with DDP's `ddp_kwargs` (find_unused_parameters, bucket_cap_mb, ...),
    initialised now (parameters broadcast from rank 0 before any method of the module runs: the composed forward
    may call `get_input_embeddings()` before the module's own forward)."""
    return composable_replicate(module, device, ddp_kwargs)


def set_gradient_sync(module: nn.Module, enabled: bool) -> None:
    """Off inside an accumulation window (no all-reduce); on for its last micro-step."""
    module.set_requires_gradient_sync(enabled)
