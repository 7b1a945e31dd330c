"""A rank's `state/` shard files planned on the rank alone: what `ShardWriter` writes under `dcp.save`, without
DCP's collectives (so the writer process needs no process group).

DCP's own planner (`DefaultSavePlanner.create_local_plan`, no collective) lists this rank's write items: a DTensor's
local shard with its global offsets, a plain tensor whole. DCP's global step would then write each plain tensor
(replicated: DDP, a module without process group) once, on one rank; here every rank makes the same choice alone,
from the same list: plain tensors by size (largest first, then by name), each to the rank with the fewest such
bytes so far. This holds because every rank holds the same plain keys with the same shapes (a replicated module's
optimizer state, the buffers), as DCP's deduplication assumes too. The files are what `ShardWriter` writes (its
header, `threads` files balanced by size, numbered by rank from 1): `ShardReader` reads and reshards them alike.
"""

from __future__ import annotations

import torch
from torch.distributed.checkpoint import DefaultSavePlanner
from torch.distributed.checkpoint.planner import WriteItemType

from .shard_writer import header


def shard_files(state: dict, rank: int, world: int, threads: int) -> list[tuple[str, bytes, list[torch.Tensor]]]:
    """(file name, header bytes, tensors in file order) of each file this rank writes for `state` (staged)."""
    planner = DefaultSavePlanner()
    planner.set_up_planner(state, None, rank == 0)
    items = []
    for item in planner.create_local_plan().items:
        if item.tensor_data is None:
            raise TypeError(f"{item.index.fqn} is not a tensor (only tensors go into state shards)")
        items.append((item, planner.resolve_data(item)))
    plain = sorted((i for i in items if i[0].type == WriteItemType.TENSOR),
                   key=lambda i: (-i[1].numel() * i[1].element_size(), i[0].index.fqn))
    loads, mine = [0] * world, [i for i in items if i[0].type != WriteItemType.TENSOR]
    for item, tensor in plain:
        at = loads.index(min(loads))
        loads[at] += tensor.numel() * tensor.element_size()
        if at == rank:
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
