"""Reading each byte once under HSDP: each tensor's shards are read from disk by one replica — tensor i by replica
i mod R over the replicate dimension, so the R replicas share the reading — and sent to the others over that
dimension (one broadcast per tensor), instead of R replicas reading the same rows. A mesh with several replicate
dimensions has its first replica read everything. Plain tensors among them (buffers, step counts) are small and
read by every rank. A module every rank holds whole (DDP, or not wrapped, read with `replicated`) is read in
stripes: its tensors dealt to the ranks by bytes (largest first, each to the least loaded rank: no rank reads more
than 1 / world of the bytes plus one tensor), each rank reads its own, then each tensor is broadcast from its
reader. For a module replicated nowhere (full shard, one process) nothing changes. A shard is whatever box its
`Shard(dim)` placement gives (`box.local_box`: rows, columns, ...): the replicas of one shard hold the same box, so
it is sent as is.

Every rank of a module's mesh must call these with the same tensors in the same order; the readers agree that they
read before any broadcast, so a reader that fails raises on every rank instead of leaving one waiting.
"""

from __future__ import annotations

import torch

from ..compat import tree_flatten, tree_unflatten
from ..core.dist import agreed, checkpoint_group, has_process_group, is_main, world_size


def _replicate_dims(tensor) -> list[int]:
    from torch.distributed.tensor import Replicate

    if not hasattr(tensor, "placements"):
        return []
    return [dim for dim, p in enumerate(tensor.placements) if isinstance(p, Replicate)
            and tensor.device_mesh.size(dim) > 1]


def owner(index: int, tensor) -> int:
    """The replica (along the one replicate dimension) that reads tensor `index`: 0 with several dimensions."""
    dims = _replicate_dims(tensor)
    return index % tensor.device_mesh.size(dims[0]) if len(dims) == 1 else 0


def reads(index: int, tensor) -> bool:
    """Whether this rank reads tensor `index`'s share itself (every rank for a tensor with no replicas)."""
    dims = _replicate_dims(tensor)
    if len(dims) == 1:
        return tensor.device_mesh.get_local_rank(dims[0]) == owner(index, tensor)
    return all(tensor.device_mesh.get_local_rank(dim) == 0 for dim in dims)


def readers(tensors, replicated: bool = False) -> tuple[list[bool], bool]:
    """Whether this rank reads each of `tensors` itself in `read_once` (the same `replicated`), and whether the
    reading is split between the ranks (the same answer on every rank: then they agree on what the readers found)."""
    import torch.distributed as dist

    if replicated_mesh(tensors) is not None:
        return [reads(i, tensor) for i, tensor in enumerate(tensors)], True
    if _whole(tensors, replicated):
        owners, rank = stripes(tensors, dist.get_world_size()), dist.get_rank()
        return [reader == rank for reader in owners], True
    return [True] * len(tensors), False


def stripes(tensors, world: int) -> list[int]:
    """The rank that reads each of `tensors` (held whole by every rank): dealt by bytes, largest first, each to the
    least loaded rank (ties: the lowest), so a rank reads at most 1 / world of the bytes plus one tensor."""
    import heapq

    sizes = [t.numel() * t.element_size() for t in tensors]
    loads, owners = [(0, rank) for rank in range(world)], [0] * len(tensors)  # a heap of (bytes dealt, rank)
    for i in sorted(range(len(tensors)), key=lambda i: -sizes[i]):
        load, owners[i] = heapq.heappop(loads)
        heapq.heappush(loads, (load + sizes[i], owners[i]))
    return owners


def _whole(tensors, replicated: bool) -> bool:
    """Every rank holds `tensors` whole (a module under DDP): they are read in stripes (`stripes`)."""
    import torch.distributed as dist

    return bool(replicated and has_process_group() and dist.get_world_size() > 1 and tensors and
                not any(hasattr(t, "placements") for t in tensors))


def replicated_mesh(tensors) -> tuple | None:
    """(mesh, the dimension the tensors are sharded over) of the first DTensor in `tensors` that has replicas,
    else None."""
    from torch.distributed.tensor import Shard

    for tensor in tensors:
        if _replicate_dims(tensor):
            shard = next((d for d, p in enumerate(tensor.placements) if isinstance(p, Shard)), None)
            return tensor.device_mesh, shard
    return None


def _broadcast(local: torch.Tensor, group, source: int) -> None:
    import torch.distributed as dist

    buffer = local if local.is_contiguous() else local.contiguous()
    if buffer.device.type == "cpu" and "nccl" in str(dist.get_backend(group)).lower():  # an offloaded shard
        buffer = buffer.to(torch.device("cuda", torch.cuda.current_device()))
    dist.broadcast(buffer, src=source, group=group)
    if buffer is not local:
        local.copy_(buffer)


@torch.no_grad()
def share_from_readers(tensors) -> None:
    """Each replicated DTensor's local shard, from the replica that read it to the others (in place)."""
    import torch.distributed as dist

    for index, tensor in enumerate(tensors):
        dims = _replicate_dims(tensor)
        local = tensor.to_local() if dims else None
        for dim in dims:
            group = tensor.device_mesh.get_group(dim)
            _broadcast(local, group, dist.get_global_rank(group, owner(index, tensor)))


def read_once(tensors: list, read, what: str, replicated: bool = False) -> None:
    """`read(i)` fills `tensors[i]` (only after every check passed: nothing is half-overwritten). Under HSDP each
    tensor's owner replica reads it, the ranks agree that they did, and it sends the others; with `replicated`
    (every rank calls this for a module held whole on every rank, DDP) each rank reads its stripe (`stripes`) and
    broadcasts it. Each byte is then read once in all."""
    import torch.distributed as dist

    if replicated_mesh(tensors) is not None:
        with agreed(what, checkpoint_group()):
            for i, tensor in enumerate(tensors):
                if reads(i, tensor):
                    read(i)
        return share_from_readers(tensors)
    if not _whole(tensors, replicated):
        for i in range(len(tensors)):
            read(i)
        return
    owners, rank = stripes(tensors, dist.get_world_size()), dist.get_rank()
    with agreed(what, checkpoint_group()):
        for i in range(len(tensors)):
            if owners[i] == rank:
                read(i)
    for tensor, reader in zip(tensors, owners):  # one broadcast per tensor, from the rank that read it
        _broadcast(tensor, dist.group.WORLD, reader)


@torch.no_grad()
def share_from_rank0(tensors) -> None:
    """Plain tensors every rank holds whole, from rank 0 to every rank (in place)."""
    import torch.distributed as dist

    for tensor in tensors:
        _broadcast(tensor, dist.group.WORLD, 0)


def load_once(state: dict, reader, what: str) -> None:
    """`dcp.load` in place (`reader(group=, alone=)`: a new storage reader for a load over `group`, or by one
    process), every byte read once in all: under HSDP each replica
    loads the tensors it owns (DCP over its shard group; plain tensors on every replica) and sends them to the
    others; a module held whole by every rank (DDP) is read by rank 0, then broadcast."""
    import torch.distributed.checkpoint as dcp

    leaves, spec = tree_flatten(state)
    tensors = [t for t in leaves if torch.is_tensor(t)]
    found, sharded = replicated_mesh(tensors), any(hasattr(t, "placements") for t in tensors)
    if found is None and not sharded and has_process_group() and world_size() > 1:
        with agreed(what, checkpoint_group()):
            if is_main():
                dcp.load(state, storage_reader=reader(alone=True), no_dist=True)
        return share_from_rank0(tensors)
    if found is None:
        return dcp.load(state, storage_reader=reader())
    mesh, shard_dim = found
    group = mesh.get_group(shard_dim) if shard_dim is not None else None
    numbers = {id(t): i for i, t in enumerate(tensors)}
    mine = tree_unflatten([leaf if not torch.is_tensor(leaf) or reads(numbers[id(leaf)], leaf) else None
                           for leaf in leaves], spec)
    with agreed(what, checkpoint_group()):
        dcp.load(_without_none(mine), storage_reader=reader(group=group), process_group=group)
    share_from_readers(tensors)


def _without_none(value):
    """A nested dict without its None leaves (the tensors another replica reads)."""
    if isinstance(value, dict):
        return {k: _without_none(v) for k, v in value.items() if v is not None}
    return value
