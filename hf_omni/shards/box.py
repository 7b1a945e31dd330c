"""This rank's share of a tensor: for a DTensor, the box of the global tensor it holds (one slice per dim, from each
`Shard(d)` placement, in torch's chunk layout; `Replicate` mesh dims add nothing), copying a value into it, and a
row-sharded view of it for writers of row-major files.

Any `Shard(d)` is served; refused with a clear error: two mesh dims sharding one tensor dim, `_StridedShard`
(FSDP2 over tensor parallelism) and `Partial` (a pending reduction: no file value).
"""

from __future__ import annotations

import torch

from .device import on_group_device

Box = tuple[slice, ...]


def _chunk(size: int, count: int, index: int) -> slice:
    """Part `index` of `count` of `size` elements, as `torch.chunk` (and DTensor's `Shard`) cut them: ceil-sized
    parts, the last ones short or empty."""
    step = -(-size // count) if size else 0
    start = min(index * step, size)
    return slice(start, min(start + step, size))


def shard_dims(tensor) -> dict[int, int]:
    """{tensor dim: the mesh dim sharding it} of a DTensor ({} for a plain tensor); refuses what `local_box` cannot
    describe."""
    if not hasattr(tensor, "placements"):
        return {}
    from torch.distributed.tensor import Replicate, Shard

    out: dict[int, int] = {}
    for mesh_dim, placement in enumerate(tensor.placements):
        if isinstance(placement, Replicate):
            continue
        if type(placement) is not Shard:  # a subclass (`_StridedShard`), or `Partial`
            raise NotImplementedError(f"hf_omni reads and writes tensors sharded with plain Shard(dim) placements "
                                      f"(and Replicate), got {tensor.placements}")
        dim = placement.dim % max(tensor.ndim, 1)
        if dim in out:
            raise NotImplementedError(f"hf_omni does not read or write a tensor dim sharded over two mesh dims "
                                      f"(dim {dim}: {tensor.placements})")
        out[dim] = mesh_dim
    return out


def local_box(tensor) -> Box | None:
    """The box of the global tensor this rank holds of a DTensor (one slice per dim; a dim no placement shards is
    whole); None for a plain tensor."""
    if not hasattr(tensor, "placements"):
        return None
    dims, mesh = shard_dims(tensor), tensor.device_mesh
    return tuple(_chunk(size, mesh.size(dims[d]), mesh.get_local_rank(dims[d])) if d in dims else slice(0, size)
                 for d, size in enumerate(tensor.shape))


def local_rows(tensor) -> tuple[int, int] | None:
    """Rows [start, stop) of dim 0 this rank holds (a tensor sharded on other dims holds parts of them: see
    `as_rows`); None for a plain tensor."""
    box = local_box(tensor)
    return None if box is None else ((box[0].start, box[0].stop) if box else (0, 1))


def local_of(tensor) -> torch.Tensor:
    """This rank's local tensor (a DTensor's shard, or the tensor itself)."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def copy_into(tensor: torch.Tensor, value) -> None:
    """Copy `value` (the tensor's local box, or the whole of a plain tensor) into `tensor` in place, cast to its
    dtype."""
    local = local_of(tensor)
    local.copy_(value.to(local.dtype))


def box_of(value: torch.Tensor, tensor) -> torch.Tensor:
    """This rank's box of a full `value` of `tensor` (all of it for a plain tensor)."""
    box = local_box(tensor)
    return value if box is None else value[box]


def sharded_off_rows(tensor) -> bool:
    """Whether a DTensor is sharded on some dim other than 0 (writers then need `as_rows`)."""
    return any(d != 0 for d in shard_dims(tensor))


def as_rows(tensor):
    """`tensor` with its shards on dim 0: a DTensor sharded on dims other than 0 redistributed to `Shard(0)` (its
    other placements kept), anything else as is. A collective every rank of its mesh joins, in the same order; it
    costs one all-to-all of the tensor's shards (NCCL: each rank sends and receives about its shard's bytes) and one
    extra shard held while the result lives. It runs on the device the mesh serves (an offloaded module's shards go
there and back: `device.on_group_device`). gloo (CPU) has no all-to-all: torch all-gathers the tensor over the
    shard group and keeps its chunk, so each rank briefly holds that one tensor whole. A tensor sharded on two dims
    is refused."""
    if not sharded_off_rows(tensor):
        return tensor
    from torch.distributed.tensor import Shard

    if len(shard_dims(tensor)) > 1:
        raise NotImplementedError(f"hf_omni writes a tensor sharded on one dim only, got {tensor.placements}")
    placements = [Shard(0) if isinstance(p, Shard) else p for p in tensor.placements]
    return on_group_device(lambda t: t.redistribute(t.device_mesh, placements), tensor.detach())
