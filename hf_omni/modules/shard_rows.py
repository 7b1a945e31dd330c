"""This rank's rows of a tensor sharded on dim 0 (a DTensor, torch.chunk layout): which rows it holds, and copying
a value into them.
"""

from __future__ import annotations

import torch


def local_rows(tensor) -> tuple[int, int] | None:
    """Rows [start, stop) of dim 0 this rank holds of a DTensor sharded on dim 0 (torch.chunk layout) over one
    mesh dimension, replicated over any other (HSDP); None for a plain tensor."""
    if not hasattr(tensor, "to_local"):
        return None
    from torch.distributed.tensor import Replicate, Shard

    sharded = [i for i, p in enumerate(tensor.placements) if isinstance(p, Shard) and p.dim == 0]
    if len(sharded) != 1 or len(sharded) + sum(isinstance(p, Replicate) for p in tensor.placements) != \
            len(tensor.placements):
        raise NotImplementedError(f"hf_omni reads dim-0 shards (replicated elsewhere) only, got {tensor.placements}")
    mesh = tensor.device_mesh
    rank, world = mesh.get_local_rank(sharded[0]), mesh.size(sharded[0])
    full = tensor.shape[0]
    chunk = -(-full // world)
    start = min(rank * chunk, full)
    return start, min(start + chunk, full)


def copy_rows(tensor: torch.Tensor, full_or_rows) -> None:
    """Copy a value into `tensor` in place (a sharded tensor: into its local shard), casting to its dtype."""
    local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
    local.copy_(full_or_rows.to(local.dtype))
