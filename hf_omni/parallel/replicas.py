"""Reading each byte once under HSDP: the first replica reads its shards from disk, the other replicas receive them
over the replicate dimension (one broadcast per tensor and replicate dimension), instead of R replicas reading the
same rows. For a module replicated nowhere (full shard, DDP, one process) everything here is a no-op.

Every rank of a module's mesh must call `share_from_first_replica` with the same tensors in the same order; a
reader that fails raises before it (the caller agrees on the reads first), so no rank waits in a broadcast.
"""

from __future__ import annotations

import torch


def _replicate_dims(tensor) -> list[int]:
    from torch.distributed.tensor import Replicate

    if not hasattr(tensor, "placements"):
        return []
    return [dim for dim, p in enumerate(tensor.placements) if isinstance(p, Replicate)
            and tensor.device_mesh.size(dim) > 1]


def is_reader(tensor) -> bool:
    """Whether this rank reads `tensor`'s rows itself: it is in the first replica (every rank, when `tensor` is
    not a DTensor replicated over some mesh dimension)."""
    return all(tensor.device_mesh.get_local_rank(dim) == 0 for dim in _replicate_dims(tensor))


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
def share_from_first_replica(tensors) -> None:
    """Each replicated DTensor's local shard, from the first replica to the others (in place); a plain tensor
    among them (a buffer, a step count: the same on every rank) goes along the replicate dimensions of the first
    replicated DTensor's mesh."""
    import torch.distributed as dist

    found = replicated_mesh(tensors)
    if found is None:
        return
    mesh = found[0]
    plain = [dim for dim in range(mesh.ndim) if dim != found[1] and mesh.size(dim) > 1]
    for tensor in tensors:
        local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
        groups = [tensor.device_mesh.get_group(d) for d in _replicate_dims(tensor)] if hasattr(tensor, "placements") \
            else [mesh.get_group(d) for d in plain]
        for group in groups:
            _broadcast(local, group, dist.get_global_rank(group, 0))


def read_once(tensors: list, read, what: str, replicated: bool = False) -> None:
    """`read(i)` fills `tensors[i]` (only after every check passed: nothing is half-overwritten). Under HSDP only
    the first replica reads, the ranks agree that it did, and it sends the others their shards; with `replicated`
    (every rank calls this for a module held whole on every rank, DDP) rank 0 reads and broadcasts it. Each byte
    is then read once in all."""
    import torch.distributed as dist

    from ..dist import agreed, checkpoint_group, has_process_group

    if replicated_mesh(tensors) is not None:
        with agreed(what, checkpoint_group()):
            for i, tensor in enumerate(tensors):
                if is_reader(tensor):
                    read(i)
        return share_from_first_replica(tensors)
    whole = replicated and has_process_group() and dist.get_world_size() > 1 and tensors and \
        not any(hasattr(t, "placements") for t in tensors)
    if not whole:
        for i in range(len(tensors)):
            read(i)
        return
    with agreed(what, checkpoint_group()):
        if dist.get_rank() == 0:
            for i in range(len(tensors)):
                read(i)
    share_from_rank0(tensors)


@torch.no_grad()
def share_from_rank0(tensors) -> None:
    """Plain tensors every rank holds whole, from rank 0 to every rank (in place)."""
    import torch.distributed as dist

    for tensor in tensors:
        _broadcast(tensor, dist.group.WORLD, 0)


def load_once(state: dict, reader, what: str) -> None:
    """`dcp.load` in place (`reader()`: a new storage reader), every byte read once in all: under HSDP by the first replica (DCP over its shard group),
    which sends the others their shards; a module held whole by every rank (DDP) by rank 0, then broadcast."""
    import torch.distributed.checkpoint as dcp
    from torch.utils._pytree import tree_leaves

    from ..dist import agreed, checkpoint_group, has_process_group, is_main, world_size

    tensors = [t for t in tree_leaves(state) if torch.is_tensor(t)]
    found, sharded = replicated_mesh(tensors), any(hasattr(t, "placements") for t in tensors)
    if found is None and not sharded and has_process_group() and world_size() > 1:
        with agreed(what, checkpoint_group()):
            if is_main():
                dcp.load(state, storage_reader=reader(), no_dist=True)
        return share_from_rank0(tensors)
    if found is None:
        return dcp.load(state, storage_reader=reader())
    mesh, shard_dim = found
    group = mesh.get_group(shard_dim) if shard_dim is not None else None
    first = all(is_reader(t) for t in tensors if hasattr(t, "placements"))
    with agreed(what, checkpoint_group()):
        if first:
            dcp.load(state, storage_reader=reader(), process_group=group)
    share_from_first_replica(tensors)
