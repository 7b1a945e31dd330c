"""A toy parallel strategy, the recipe of docs/how_it_works.md "Add a strategy": FSDP2 with every parameter of 2+
dims sharded on dim 1 (its columns, where they divide evenly: FSDP2 asks it) and 1-D ones on dim 0, over all ranks;
one file plus one `register_strategy` call, `parallel: fsdp_dim1`. Importing this module registers it (tests, and
launched scripts through `tests/` on their import path)."""

from __future__ import annotations

import torch
from torch import nn

from hf_omni import register_strategy
from hf_omni.compat import fsdp_lazy_init_root, no_split_modules
from hf_omni.modules.embeddings import embeddings_of
from hf_omni.parallel.fsdp import full_state_dict, is_sharded
from hf_omni.parallel.strategy import Strategy

NAME = "fsdp_dim1"


def column_placement(ranks: int):
    """`shard_placement_fn` over `ranks` ranks: columns for matrices (and higher), rows for vectors. FSDP2 shards
    unevenly on dim 0 only: a matrix whose columns do not divide by `ranks` keeps rows."""
    from torch.distributed.tensor import Shard

    return lambda param: Shard(1) if param.ndim >= 2 and param.shape[1] % ranks == 0 else Shard(0)


class ColumnShardStrategy(Strategy):
    """`fully_shard` per transformer block, the input embeddings as their own unit (the composed forward calls them
    before the module's own forward), then the module root, every matrix on `Shard(1)` (where its columns divide
evenly)."""

    description = "FSDP2 with every matrix on its columns (Shard(1)): a test of the strategy extension point"
    collective = True  # its forward and backward all-gather / reduce-scatter: every rank must enter them
    shards = True  # parameters are DTensors: an `empty_init` module is sharded on meta, then each rank reads its box

    def __init__(self, module_name: str, mesh=None, lazy_init: bool = True):
        super().__init__(module_name, None, mesh)
        self.lazy_init, self.module = lazy_init, None

    @classmethod
    def for_module(cls, slot, mesh=None, lazy_init: bool = True, meshes=None) -> "ColumnShardStrategy":
        return cls(slot.name, mesh, lazy_init)

    def apply(self, module: nn.Module, device: torch.device) -> None:
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = self.mesh if self.mesh is not None else init_device_mesh(device.type, (dist.get_world_size(),))
        kwargs = dict(mesh=mesh, shard_placement_fn=column_placement(mesh.size()))
        blocks = no_split_modules(module)
        for sub in [m for m in module.modules() if type(m).__name__ in blocks and m is not module]:
            fully_shard(sub, **kwargs)
        embed = embeddings_of(module)
        if embed is not None and not is_sharded(embed):  # not inside a block already (ViTEmbeddings)
            fully_shard(embed, **kwargs)
        fully_shard(module, **kwargs)
        if self.lazy_init:  # else `after_reading`, once its shards are read
            fsdp_lazy_init_root(module)
        self.module = module

    def after_reading(self) -> None:  # read after wrapping on meta (`lazy_init=False`)
        fsdp_lazy_init_root(self.module)

    def set_gradient_sync(self, enabled: bool) -> None:
        self.module.set_requires_gradient_sync(enabled)

    def full_state_dict(self, module: nn.Module) -> dict[str, torch.Tensor]:
        return full_state_dict(module)


register_strategy(NAME, ColumnShardStrategy)
