"""Which dim FSDP2 shards each parameter on (`fully_shard(..., shard_placement_fn=...)`).

FSDP2 shards on dim 0 by default and pads it up to a multiple of the shard group: `[E, ...]` fused MoE experts over
more ranks than experts would be padded to one whole expert per rank (Mixtral's `gate_up_proj` `[8, 28672, 4096]`
at 512 ranks: 504 ranks hold a padded expert and no data, and every all-gather moves 64x the tensor). The rule,
per parameter over a shard group of `ranks`:

- dim 0 while padding it to a multiple of `ranks` adds at most `PADDING` (5%) to the tensor;
- else the first other dim whose size divides by `ranks` (FSDP2 shards any dim but 0 evenly only: no padding);
- else dim 0 (no dim helps).

`shard_dim` is the rule; `placement_fn` is what `shard()` hands to `fully_shard`, and it looks `shard_dim` up in
this module at every call, so a test forces a placement by replacing `placement.shard_dim`.
"""

from __future__ import annotations

import math

PADDING = 0.05  # the most padding on dim 0 (a fraction of the tensor) before another dim is used


def padded_fraction(size: int, ranks: int) -> float:
    """What padding `size` up to a multiple of `ranks` adds, as a fraction of `size`."""
    return (math.ceil(size / ranks) * ranks - size) / size if size else 0.0


def shard_dim(shape: tuple[int, ...], ranks: int) -> int:
    """The dim to shard a parameter of `shape` on over `ranks` ranks (see the module docstring)."""
    if len(shape) < 2 or padded_fraction(shape[0], ranks) <= PADDING:
        return 0
    return next((d for d in range(1, len(shape)) if shape[d] % ranks == 0), 0)


def placement_fn(ranks: int):
    """`fully_shard`'s `shard_placement_fn` for a shard group of `ranks`: `Shard(shard_dim(...))`, or None (FSDP2's
    default, dim 0) where the rule keeps dim 0, and for a tensor-parallel split (a DTensor already: FSDP2 nests its
    rows inside the tensor-parallel ones, the layout `shards/box.py` reads)."""
    from torch.distributed.tensor import DTensor, Shard

    def place(param):
        if isinstance(param, DTensor):
            return None
        dim = shard_dim(tuple(param.shape), ranks)
        return Shard(dim) if dim else None

    return place
