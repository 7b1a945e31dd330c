"""A rank's `state/` shard files of an async save, planned on the rank alone (no collective, no process group).

They are what `ShardWriter` writes under `dcp.save`, without DCP's collectives, so the writer process needs no group.

DCP's own planner (`DefaultSavePlanner.create_local_plan`, no collective) lists this rank's write items: a DTensor's
local shard with its global offsets, a plain tensor whole. DCP's global step would then write each plain tensor
(replicated: DDP, a module without process group) once, on one rank; here every rank makes the same choice alone,
from the same list: plain tensors by size (largest first, then by name), each to the rank with the fewest such
bytes so far; a DTensor's shard held alike by several ranks (HSDP's replicas; a norm on `(dp_shard,)` of a
tensor-parallel module, the same on every tp rank) likewise among them. This holds because every rank holds the
same plain keys with the same shapes (a replicated module's optimizer state, the buffers), as DCP's deduplication
assumes too. The files are what `ShardWriter` writes (its
header, `threads` files balanced by size, numbered by rank from 1): `ShardReader` reads and reshards them alike.
"""

from __future__ import annotations

import torch
from torch.distributed.checkpoint import DefaultSavePlanner

from ..files.folder_derived import replica
from .shard_writer import header


def replicas(tensor, rank: int, world: int, full=None, seen: dict | None = None) -> tuple[int, int, object]:
    """(this rank's index among the ranks that hold `tensor`'s local part alike, their number, which mesh): a plain
    tensor is every rank's; a DTensor's shard is held alike along the mesh dims that replicate it (HSDP) and, in a
    tensor-parallel module (`full`: its whole mesh), along the dims its mesh lacks (`folder_derived.replica`)."""
    if not hasattr(tensor, "device_mesh"):
        return rank, world, None
    key = (id(tensor.device_mesh), tuple(str(p) for p in tensor.placements))
    if seen is None or key not in seen:
        found = replica(tensor, full)
        if seen is None:
            return (*found, key)
        seen[key] = found
    return (*seen[key], key)


def shard_files(state: dict, rank: int, world: int, threads: int, full=None
                ) -> list[tuple[str, bytes, list[torch.Tensor]]]:
    """(file name, header bytes, tensors in file order) of each file this rank writes for `state` (staged); `full`:
    a tensor-parallel module's whole mesh (`folder_write.tensor_mesh`)."""
    planner = DefaultSavePlanner()
    planner.set_up_planner(state, None, rank == 0)
    items = []
    for item in planner.create_local_plan().items:
        if item.tensor_data is None:
            raise TypeError(f"{item.index.fqn} is not a tensor (only tensors go into state shards)")
        items.append((item, planner.resolve_data(item), planner.state_dict[item.index.fqn]))
    groups: dict = {}  # items held alike by several ranks, by who holds them: (my index among them, how many)
    mine, seen = [], {}
    for item, tensor, whole in items:
        held = replicas(whole, rank, world, full, seen)
        if held[1] == 1:
            mine.append((item, tensor))
        else:
            groups.setdefault(held, []).append((item, tensor))
    for (me, count, _), shared in groups.items():  # each to the replica with the fewest such bytes so far
        loads = [0] * count
        for item, tensor in sorted(shared, key=lambda i: (-i[1].numel() * i[1].element_size(), i[0].index.fqn)):
            at = loads.index(min(loads))
            loads[at] += tensor.numel() * tensor.element_size()
            if at == me:
                mine.append((item, tensor))
    mine.sort(key=lambda i: -i[0].tensor_data.size.numel())
    bins: list[list] = [[] for _ in range(min(max(1, threads), len(mine)))]
    sizes = [0] * len(bins)
    for item, tensor in mine:  # the largest item into the emptiest file, as ShardWriter does
        at = sizes.index(min(sizes))
        bins[at].append((item.index.fqn, tensor, list(item.tensor_data.chunk.offsets)))
        sizes[at] += tensor.numel()
    return [(f"shard-{rank + 1:05d}-{i + 1:05d}-of-{len(bins):05d}.safetensors", header(b), [t for _, t, _ in b])
            for i, b in enumerate(bins)]
