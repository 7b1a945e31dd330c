"""`parallel: ddp`: data parallel in place with torch's composable `replicate` (DDP's bucketed all-reduce, no
wrapper object: `model.llm` keeps its class, as a generated `DDP...` subclass, and its methods).

Composable `replicate` builds its DDP over the parameters alone, so it never syncs buffers; with DDP's
`broadcast_buffers` (Trainer's default) hf_omni broadcasts the module's buffers from rank 0 before each forward,
as `DistributedDataParallel` does: BatchNorm running statistics agree across ranks at every step and in
evaluation.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from ..compat import composable_replicate


def apply(module: nn.Module, device: torch.device, ddp_kwargs: dict) -> nn.Module:
    """Replicate `module` over all ranks with DDP's `ddp_kwargs` (find_unused_parameters, bucket_cap_mb, ...),
    initialised now (parameters broadcast from rank 0 before any method of the module runs: the composed forward
    may call `get_input_embeddings()` before the module's own forward)."""
    broadcast = ddp_kwargs.get("broadcast_buffers", True)
    composable_replicate(module, device, ddp_kwargs)
    buffers = [b for b in module.buffers() if b.numel()]
    if broadcast and buffers:
        broadcast_buffers(buffers)
        module.register_forward_pre_hook(lambda mod, args: broadcast_buffers(buffers))
    return module


def broadcast_buffers(buffers: list[torch.Tensor]) -> None:
    """Rank 0's values into every rank's buffers, one collective per dtype."""
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for buf in buffers:
        by_dtype.setdefault(buf.dtype, []).append(buf)
    for group in by_dtype.values():
        flat = torch.cat([b.detach().reshape(-1) for b in group])
        dist.broadcast(flat, src=0)
        offset = 0
        with torch.no_grad():
            for buf in group:
                buf.copy_(flat[offset:offset + buf.numel()].view_as(buf))
                offset += buf.numel()


def set_gradient_sync(module: nn.Module, enabled: bool) -> None:
    """Off inside an accumulation window (no all-reduce); on for its last micro-step."""
    module.set_requires_gradient_sync(enabled)
