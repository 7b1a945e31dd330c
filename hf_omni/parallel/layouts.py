"""Layers a `parallel: fsdp` module composes under FSDP2 from its `parallelism` sizes, found by size key
(`tp_size`: `tensor.py`, `ep_size`: `experts.py`). A layout splits the module over its own dim of the module's mesh
(tensor parallelism) or over a mesh of its own on the same ranks (expert parallelism) before FSDP2 shards the rest
over the data-parallel dims, then installs what the rest of the (data-parallel) composed model needs around it.
A new layout is one file with a `Layout` subclass and `@register_layout`; `fsdp.py` asks the registry, never the
class."""

from __future__ import annotations

from torch import nn

LAYOUTS: dict[str, type["Layout"]] = {}


def register_layout(cls: type["Layout"]) -> type["Layout"]:
    LAYOUTS[cls.size_key] = cls
    return cls


def layouts_for(module_name: str, parallelism: dict | None, meshes=None) -> list["Layout"]:
    """The layouts a module's `parallelism` entry asks for (a size above 1), in registration order; `meshes`: the
    run's `mesh.Meshes` (where a layout builds a mesh of its own)."""
    sizes = parallelism or {}
    return [cls(module_name, sizes, meshes) for key, cls in LAYOUTS.items() if sizes.get(key, 1) > 1]


class Layout:
    size_key = ""
    dim = ""  # its dim of the module's mesh ("": none, a mesh of its own)

    def __init__(self, module_name: str, sizes: dict, meshes=None):
        self.module_name, self.sizes, self.meshes = module_name, sizes, meshes

    def size(self, key: str) -> int:
        return self.sizes.get(key, 1)

    def check(self, module: nn.Module) -> None:
        """Refuse, naming the module and `parallelism.<size_key>`, what it cannot split (before anything is)."""

    def apply(self, module: nn.Module, mesh) -> None:
        """Split `module` over `mesh[self.dim]`, before FSDP2."""

    def shard_first(self, module: nn.Module, kwargs: dict) -> None:
        """Shard, on a mesh of its own, what it split before FSDP2's units over the data-parallel dims take the rest
        (`kwargs`: the module's `fully_shard` settings)."""

    def after_fsdp(self, module: nn.Module, mesh, methods: tuple[str, ...]) -> None:
        """What the rest of the composed model needs around the split module (its boundary), after FSDP2;
        `methods`: those other than `forward` a composed forward may call on it."""


def data_mesh(mesh, layouts: list[Layout]):
    """The data-parallel dims of a module's mesh (what FSDP2 shards over): the mesh itself without layouts."""
    if not layouts:
        return mesh
    names = tuple(n for n in mesh.mesh_dim_names if n not in {layout.dim for layout in layouts if layout.dim})
    return mesh[names if len(names) > 1 else names[0]]
