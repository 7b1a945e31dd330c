"""What FSDP2's padding costs a module at a large world size, measured in one process: torch's fake process group
(collectives move nothing) lets this process shard the module as rank r of W would, on the meta device, and FSDP2's
own padded shard of each parameter is read back (`compat.fsdp_padded_shards`).

Per parameter: its bytes, the bytes one all-gather of it outputs on a rank (W x the padded shard: what every
forward and backward moves), and the padded shard a rank keeps where it holds none of the parameter's data (the
last rank: torch's chunk layout leaves the tail ranks empty). `bench/experts.py` prints these for a Mixtral-like
layer; tests/test_expert_placement.py holds them to their goals.
"""

from __future__ import annotations

import torch
from torch import nn

from ..compat import fsdp_padded_shards, init_fake_process_group


def mixtral_layer() -> nn.Module:
    """One decoder layer of Mixtral-8x7B (transformers' default `MixtralConfig`: 8 experts, `gate_up_proj`
    `[8, 28672, 4096]`), fp32, on the meta device."""
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralDecoderLayer

    with torch.device("meta"):
        return MixtralDecoderLayer(MixtralConfig(), layer_idx=0)


def sharded_as(build, world: int, rank: int, placement_fn) -> dict[str, dict]:
    """`build()` fully sharded over `world` ranks as `rank` sees it (`placement_fn(world)`: the
    `shard_placement_fn`), one row per parameter: dim, bytes, gathered (one all-gather's output), padded_shard (the
    padded shard this rank keeps), local (the bytes of data it holds)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    init_fake_process_group(rank, world)
    try:
        module = build()
        fully_shard(module, mesh=init_device_mesh("cpu", (world,)), shard_placement_fn=placement_fn(world))
        params = dict(module.named_parameters())
        out = {}
        for name, (dim, padded) in fsdp_padded_shards(module).items():
            param, size = params[name], params[name].element_size()
            out[name] = dict(dim=dim, shape=tuple(param.shape), bytes=param.numel() * size,
                             gathered=world * padded.numel() * size, padded_shard=padded.numel() * size,
                             local=param.to_local().numel() * size)
        return out
    finally:
        dist.destroy_process_group()


def padding_figures(build, world: int, placement_fn) -> dict:
    """For the module `build()` makes, sharded over `world` ranks: per parameter (`tensors`) its dim, bytes and
    gathered / bytes; in all: `ratio` (bytes all of its all-gathers output on a rank / its bytes), `worst` (the
    largest ratio of one parameter) and `idle_padding` (the padded bytes the last rank keeps of the parameters it
    holds no data of)."""
    last = sharded_as(build, world, world - 1, placement_fn)
    tensors = {name: dict(dim=row["dim"], shape=row["shape"], bytes=row["bytes"],
                          ratio=row["gathered"] / row["bytes"], idle=row["padded_shard"] if not row["local"] else 0)
               for name, row in last.items()}
    return dict(tensors=tensors, bytes=sum(r["bytes"] for r in last.values()),
                ratio=sum(r["gathered"] for r in last.values()) / sum(r["bytes"] for r in last.values()),
                worst=max(t["ratio"] for t in tensors.values()), idle_padding=sum(t["idle"] for t in tensors.values()))


def dim0_placement(world: int):
    """FSDP2's default placement (every parameter on dim 0), for comparison."""
    return lambda param: None
