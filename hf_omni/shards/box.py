"""This rank's share of a tensor: for a DTensor, the box of the global tensor it holds (one slice per dim, from its
`Shard(d)` placements, in torch's chunk layout; `Replicate` mesh dims add nothing), copying a value into it, and a
row-sharded view of it for writers of row-major files.

A tensor dim may be cut by several mesh dims: plain `Shard(d)`s cut it in mesh order, each inside the part the one
before left, and a `_StridedShard(d, sf)` (FSDP2 over a tensor already sharded on d by tensor or expert parallelism:
`(_StridedShard(0, sf=T), Shard(0))` on `(dp_shard, tp)`) cuts last, inside the part of the plain `Shard(d)`s after
it in the mesh (sf is the number of their parts). Each cut is `torch.chunk`'s, so the share is always one box.
Refused with a clear error: `Partial` (a pending reduction: no file value), any other placement, and a
`_StridedShard` that is not that (a plain `Shard` of the same dim before it, or a split factor other than the parts
of those after it).
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


def shard_dims(tensor) -> dict[int, list[int]]:
    """{tensor dim: the mesh dims cutting it, in the order they cut it (outer first)} of a DTensor ({} for a plain
    tensor); refuses what `local_box` cannot describe."""
    if not hasattr(tensor, "placements"):
        return {}
    from torch.distributed.tensor import Replicate, Shard

    from ..compat import strided_shard_factor

    plain: dict[int, list[int]] = {}
    strided: dict[int, tuple[int, int]] = {}
    for mesh_dim, placement in enumerate(tensor.placements):
        if isinstance(placement, Replicate):
            continue
        factor = strided_shard_factor(placement)
        if factor is None and type(placement) is not Shard:  # `Partial`, or a placement hf_omni does not know
            raise NotImplementedError(f"hf_omni reads and writes tensors sharded with Shard(dim) placements (and "
                                      f"Replicate; FSDP2's _StridedShard over them), got {tensor.placements}")
        dim = placement.dim % max(tensor.ndim, 1)
        if factor is None:
            plain.setdefault(dim, []).append(mesh_dim)
        elif dim in strided:
            raise NotImplementedError(f"hf_omni does not read or write a tensor dim cut by two _StridedShard "
                                      f"placements (dim {dim}: {tensor.placements})")
        else:
            strided[dim] = (mesh_dim, factor)
    for dim, (mesh_dim, factor) in strided.items():
        inner = plain.get(dim, [])
        parts = 1
        for other in inner:
            parts *= tensor.device_mesh.size(other)
        if not inner or min(inner) < mesh_dim or factor != parts:
            raise NotImplementedError(f"hf_omni reads and writes a _StridedShard(dim, sf) only over plain "
                                      f"Shard(dim)s after it in the mesh that cut the dim into sf parts (FSDP2 over "
                                      f"tensor parallelism), got {tensor.placements} on a mesh of shape "
                                      f"{tuple(tensor.device_mesh.shape)}")
    return {dim: plain.get(dim, []) + ([strided[dim][0]] if dim in strided else [])
            for dim in sorted({*plain, *strided})}


def local_box(tensor) -> Box | None:
    """The box of the global tensor this rank holds of a DTensor (one slice per dim; a dim no placement shards is
    whole; a dim several mesh dims shard is cut by each in turn, `shard_dims`' order); None for a plain tensor."""
    if not hasattr(tensor, "placements"):
        return None
    mesh, box = tensor.device_mesh, [slice(0, size) for size in tensor.shape]
    for dim, mesh_dims in shard_dims(tensor).items():
        for mesh_dim in mesh_dims if dim < len(box) else ():  # a 0-d tensor has no dim to cut
            start = box[dim].start
            part = _chunk(box[dim].stop - start, mesh.size(mesh_dim), mesh.get_local_rank(mesh_dim))
            box[dim] = slice(start + part.start, start + part.stop)
    return tuple(box)


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
    shard group and keeps its chunk, so each rank briefly holds that one tensor whole. A tensor sharded on dim 0 and
    on others (tensor parallelism's rowwise `(Shard(0), Shard(1))` on `(dp_shard, tp)`): its other dims gathered
    (an all-gather over `tp`: each rank receives and holds its dim-0 shard's full rows, 1/S of the tensor, then
    writes 1/T of them as a replica). Two dims off dim 0, or one cut by several mesh dims, are refused."""
    if not sharded_off_rows(tensor):
        return tensor
    from torch.distributed.tensor import Replicate, Shard

    dims = shard_dims(tensor)
    if 0 in dims:  # tensor parallelism's rowwise (Shard(0), Shard(1)): gathered over the mesh dims cutting the rest
        placements = [Replicate() if isinstance(p, Shard) and p.dim % tensor.ndim else p for p in tensor.placements]
    elif len(dims) > 1 or any(len(mesh_dims) > 1 for mesh_dims in dims.values()):
        raise NotImplementedError(f"hf_omni writes a tensor sharded off dim 0 only when one mesh dim shards one "
                                  f"tensor dim, or dim 0 is sharded too, got {tensor.placements}")
    else:
        placements = [Shard(0) if isinstance(p, Shard) else p for p in tensor.placements]
    return on_group_device(lambda t: t.redistribute(t.device_mesh, placements), tensor.detach())


def one_cut(tensor):
    """`tensor` with dim 0 cut by one mesh dim and no other dim cut, where dim 0 is cut and something else is too
    (FSDP2's rows or columns inside expert or tensor parallelism's rows: `(_StridedShard(0), Shard(0))`,
    `(Shard(1), Shard(0))`): every mesh dim but the outermost cutting dim 0 gathered (`Replicate`: an all-gather over
    them, each rank receiving and holding its outer part: 1/E of an expert tensor). A collective every rank of its
    mesh joins, in the same order; anything else as is."""
    from torch.distributed.tensor import Replicate

    dims = shard_dims(tensor)
    rows = dims.get(0, [])
    others = rows[1:] + [m for dim, cuts in dims.items() if dim != 0 for m in cuts]
    if not rows or not others:
        return tensor
    placements = [Replicate() if m in others else p for m, p in enumerate(tensor.placements)]
    return on_group_device(lambda t: t.redistribute(t.device_mesh, placements), tensor.detach())
