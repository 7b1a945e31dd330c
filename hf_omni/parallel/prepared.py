"""What the driver's steps share (`Run`, a `ModulePlan` per module), and what the composed model keeps of them at run
time (`Prepared`: the device, whether gradients sync now, `no_sync` over the strategies that sync)."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch

from ..modules.slot import ModuleSlot
from .strategy import Strategy


@dataclass
class Prepared:
    """The composed model at run time: where its modules run, and whether gradients sync now (False inside an
    accumulation window's micro-steps before the last)."""

    device: torch.device = torch.device("cpu")
    strategies: list[Strategy] = field(default_factory=list)  # the ones that sync gradients
    syncing: bool = True

    @contextlib.contextmanager
    def no_sync(self):
        """No gradient sync in any module inside this context (gradient accumulation)."""
        self._set_sync(False)
        try:
            yield
        finally:
            self._set_sync(True)

    def _set_sync(self, enabled: bool) -> None:
        self.syncing = enabled
        for strategy in self.strategies:
            strategy.set_gradient_sync(enabled)


@dataclass(eq=False)
class ModulePlan:
    """What the driver decided for one module that is not offline, before anything is placed."""

    slot: ModuleSlot
    strategy: type[Strategy]  # its strategy's class
    dims: object = None  # `dims.ModuleDims`, for a strategy that takes a mesh
    mesh: object = None  # its device mesh (`build_meshes`)
    read_after: str | None = None  # `empty_init`, sharded: the folder its shares are read from once wrapped
    sharded: bool = False  # loaded whole, then sharded
    cast_after: bool = False  # ... with masters to cast: on its shares, once wrapped


@dataclass(eq=False)
class Run:
    """One `prepare_modules`: its accelerator, model and decisions, in the order every rank applies them."""

    accelerator: object
    model: object
    device: torch.device
    run_dtype: torch.dtype | None
    scoped: bool  # `fsdp_scope: model` under a process group: one wrap of the composed model
    model_settings: dict | None  # ... with the top-level `fsdp_plugin`
    meshes: object  # `dims.Meshes`
    plans: list[ModulePlan] = field(default_factory=list)
    model_dims: object = None  # `fsdp_scope: model`: the top-level `parallelism`
    prepared: Prepared = None

    def __post_init__(self):
        self.prepared = Prepared(device=self.device)
