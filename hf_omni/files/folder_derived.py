"""A derived group of a module's HF folder (MoE experts split on save: the file holds one tensor per expert where
the module holds them fused): converted by one rank, round robin over the ranks of the first replica, from its
source tensors gathered there (`dist.gather` of dim-0 shards, one tensor at a time, on the device the shards' group
serves: `shards.device.on_group_device`). Expert-parallel experts (FSDP2's rows inside each rank's expert range)
are first gathered to their ranges over the ranks holding the same experts (`shards.box.one_cut`), then to the
writer over the expert group.

Every rank joins every gather of every group, whatever fails on its own between them: a rank-local step (a cast,
the conversion) that fails goes to `failed` (raised at once where no other rank waits: no process group, or a
module written by one process), and the rank goes on joining the gathers; its error is raised once
every rank has joined every collective (`folder_write`), into the agreement that follows the write, where every
rank raises it. A rank that raised at once would wait in that agreement while the others wait in its next gather.
"""

from __future__ import annotations

import torch
from torch import nn

from ..core.dist import has_process_group
from ..shards.box import local_of, one_cut, shard_dims
from ..shards.device import on_group_device
from .folder_plan import WEIGHTS, FolderPlan, adapter_state_dict, weights_keys
from .saved_keys import module_tensors


def sharded(tensor) -> bool:
    from torch.distributed.tensor import Shard

    return hasattr(tensor, "placements") and any(isinstance(p, Shard) for p in tensor.placements)


def replica(tensor, full=None) -> tuple[int, int]:
    """(this rank's replica index, replica count) over the mesh dimensions where `tensor` is replicated; `full`: the
    module's whole mesh (tensor parallelism), whose dims `tensor`'s mesh lacks are replicas too (a norm on
    `(dp_shard,)` is the same on every `tp` rank)."""
    from torch.distributed.tensor import Replicate

    mesh, index, count = tensor.device_mesh, 0, 1
    dims = [(mesh, d) for d, p in enumerate(tensor.placements) if isinstance(p, Replicate)]
    names = mesh.mesh_dim_names or ()
    if full is not None and part_of(mesh, full):
        dims += [(full, d) for d, n in enumerate(full.mesh_dim_names) if n not in names]
    for where, dim in dims:
        index, count = index * where.size(dim) + where.get_local_rank(dim), count * where.size(dim)
    return index, count


def part_of(mesh, full) -> bool:
    """Whether `mesh` is made of dims of `full` (each of its dims groups the same ranks as `full`'s dim of that
    name): a norm of the tensor-parallel module, not another module's tensor on a mesh with a dim of the same name
    (an adopted model's export writes every module with the tensor-parallel one's mesh at hand)."""
    import torch.distributed as dist

    names = full.mesh_dim_names or ()
    if not mesh.mesh_dim_names:  # unnamed: not a sub-mesh of a named one
        return False
    return all(name in names and dist.get_process_group_ranks(mesh.get_group(d)) ==
               dist.get_process_group_ranks(full.get_group(names.index(name)))
               for d, name in enumerate(mesh.mesh_dim_names or ()))


def rank_world(solo: bool = False) -> tuple[int, int]:
    import torch.distributed as dist

    return (dist.get_rank(), dist.get_world_size()) if has_process_group() and not solo else (0, 1)


def gather_to(tensor, writer: int):
    """The full tensor on rank `writer` (None elsewhere): a sharded one gathered on the dim it is sharded on (each
    shard padded to the largest), over the first replica's shard group only, on the device that group serves, the
    parts back where the shards live; a whole one is the writer's own."""
    import torch.distributed as dist

    if not sharded(tensor):
        local = local_of(tensor)
        return local if rank_world()[0] == writer else None
    from torch.distributed.tensor import Shard

    dims = shard_dims(tensor)
    if len(dims) > 1 or any(len(mesh_dims) > 1 for mesh_dims in dims.values()):  # one gather over one mesh dim
        raise NotImplementedError(f"hf_omni gathers a tensor to convert it only when one mesh dim shards one tensor "
                                  f"dim, got {tensor.placements}")
    mesh = tensor.device_mesh
    mesh_dim, dim = next((i, p.dim % tensor.ndim) for i, p in enumerate(tensor.placements) if isinstance(p, Shard))
    group, count = mesh.get_group(mesh_dim), mesh.size(mesh_dim)
    chunk = -(-tensor.shape[dim] // count)
    local = tensor.to_local()
    padded = local.new_zeros((*tensor.shape[:dim], chunk, *tensor.shape[dim + 1:]))
    padded.narrow(dim, 0, local.shape[dim]).copy_(local)

    def gather(padded):
        parts = [torch.empty_like(padded) for _ in range(count)] if dist.get_rank() == writer else None
        dist.gather(padded, parts, dst=writer, group=group)
        return parts

    parts = on_group_device(gather, padded, mesh)
    return torch.cat(parts, dim).narrow(dim, 0, tensor.shape[dim]) if parts is not None else None


def first_replica_ranks(tensor) -> list[int] | None:
    """The ranks of the first replica's shard group of a sharded tensor, when this rank is in it (else None)."""
    import torch.distributed as dist
    from torch.distributed.tensor import Shard

    if replica(tensor)[0] != 0:
        return None
    dim = next(i for i, p in enumerate(tensor.placements) if isinstance(p, Shard))
    return dist.get_process_group_ranks(tensor.device_mesh.get_group(dim))


def derived_tensors(module: nn.Module, plan: FolderPlan, index: int, dtypes: dict, solo: bool = False,
                    failed: list | None = None) -> dict | None:
    """Group `index` converted on its writer (the keys it derives, as tensors); None on the other ranks, and where
    this rank failed (its error appended to `failed`). Every rank of the first replica joins the gathers."""
    failed = [] if failed is None else failed
    kind, sources = plan.groups[index]
    tensors = module_tensors(module)
    rank, world = rank_world(solo)
    state, writer = {}, None
    for source in sources:
        tensor = one_cut(tensors[source])  # experts: FSDP2's rows inside expert ranges gathered to the ranges
        if sharded(tensor):
            ranks = first_replica_ranks(tensor)
            if ranks is None:
                continue
            writer = ranks[index % len(ranks)]
        else:
            writer = index % world
        full = gather_to(tensor, writer)  # joined whatever failed here before
        if full is not None and not failed:
            try:
                full = full.to("cpu", dtypes.get(source, full.dtype))
                state.update((key, full) for key in plan.aliases[source])
            except Exception as err:
                if solo or not has_process_group():  # no other rank waits
                    raise
                failed.append(err)
    if writer != rank or not state or failed:
        return None
    try:
        return (weights_keys if kind == WEIGHTS else adapter_state_dict)(module, state)
    except Exception as err:
        if solo or not has_process_group():  # no other rank waits
            raise
        failed.append(err)
        return None
