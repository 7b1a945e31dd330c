"""One module's place in the composed model: what the root config records of it (`entry`), where it is in its life
(`stage`), and what a run decided for it (its resolved arguments, whether it trains, its parallel strategy, its
offline encoder). `OmniModel` owns one slot per module; every other part asks the slot.

    BUILT ──────────────────────────────────────────────► WRAPPED   (prepared: its strategy applied)
    PENDING (empty_init: on meta, weights in a folder) ──► BUILT     (read whole: to encode its offline cache)
                                                       └─► WRAPPED   (sharded on meta, then each rank reads its rows)
    BUILT | PENDING ─────────────────────────────────────► OFFLINE   (on meta for good, its outputs cached)

A PENDING module may be pointed at another folder (a checkpoint to resume from) before it is read; a module WRAPPED
with nothing applied (no process group) may be prepared again.
"""

from __future__ import annotations

import enum
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from torch import nn

from ..core.config import ModuleEntry
from .precision import Precision

if TYPE_CHECKING:  # annotations only: the slot holds them, the layers above build them
    import torch

    from ..arguments.module import ModuleArguments
    from ..checkpoint.module_state import ModuleState
    from ..offline.spec import OfflineEncoder
    from ..parallel.dims import ModuleDims
    from ..parallel.strategy import Strategy
    from .ema import ModuleEMA


class Stage(enum.Enum):
    BUILT = "built"
    PENDING = "pending weights"
    OFFLINE = "offline"
    WRAPPED = "wrapped"


NEXT = {Stage.BUILT: {Stage.WRAPPED, Stage.OFFLINE}, Stage.PENDING: {Stage.PENDING, Stage.BUILT, Stage.WRAPPED,
                                                                     Stage.OFFLINE},
        Stage.OFFLINE: set(), Stage.WRAPPED: set()}


@dataclass(eq=False)
class ModuleSlot:
    """A module of the composed model and everything kept about it."""

    entry: ModuleEntry
    module: nn.Module
    processor: object | None = None  # its tokenizer / processor, saved beside it
    stage: Stage = Stage.BUILT
    weights: str | None = None  # PENDING: the folder its weights are read from
    args: "ModuleArguments | None" = None  # its resolved arguments (set by the plugin, never changed after)
    settings: object | None = None  # its strategy's typed settings, parsed once from `args` (None: it has none)
    dims: "ModuleDims | None" = None  # its parallel dimensions, for a strategy that takes a mesh (`parallel.dims`)
    layouts: list = field(default_factory=list)  # its layouts, one instance each (`parallel.layout`), when prepared
    trains: bool = False  # set when prepared: something in it still requires grad after freezing and LoRA
    strategy: "Strategy | None" = None  # WRAPPED: its strategy (none, ddp, fsdp, a registered one)
    encoder: "OfflineEncoder | None" = None  # `offline_modules`: its `@offline_encoder` spec
    precision: Precision | None = None  # when prepared: master / compute / loaded dtypes
    optimizer: "torch.optim.Optimizer | None" = None  # trainable: its own optimizer (`optim.build_optimizers`)
    scheduler: "torch.optim.lr_scheduler.LRScheduler | None" = None  # ... and its learning-rate scheduler
    grad_norm: "torch.Tensor | None" = None  # its last step's pre-clip gradient norm, on the device (never read here)
    checkpoint: "ModuleState | None" = None  # what its checkpoints keep beyond its tensors (plans, stager, base)
    ema: "ModuleEMA | None" = None  # `ema`: its EMA shadows (built with the optimizers; `modules.ema`)

    @property
    def name(self) -> str:
        return self.entry.name

    def _move(self, stage: Stage) -> None:
        if stage not in NEXT[self.stage]:
            raise RuntimeError(f"module {self.name!r} is {self.stage.value}: it cannot become {stage.value}")
        self.stage = stage

    def pend(self, folder: str) -> None:
        """Its weights come from `folder` once it is allocated (empty_init; again for a checkpoint)."""
        if self.stage is Stage.BUILT and any(not p.is_meta for p in self.module.parameters()):
            raise RuntimeError(f"module {self.name!r} holds its weights already: it cannot wait for {folder}")
        self.stage, self.weights = Stage.PENDING, folder

    def filled(self) -> None:
        """Read whole from its folder, unwrapped (to encode its offline cache)."""
        self._move(Stage.BUILT)
        self.weights = None

    def wrapped(self, strategy) -> None:
        """A strategy applied. A module prepared before with nothing applied (no process group) may be prepared
        again (a second run with the same model); one that is sharded or replicated may not."""
        if not (self.stage is Stage.WRAPPED and self.strategy.name == "none"):
            self._move(Stage.WRAPPED)
        self.strategy, self.weights = strategy, None

    def go_offline(self) -> None:
        """Every tensor moves to the meta device for good (the Parameter objects stay; their data is dropped)."""
        self._move(Stage.OFFLINE)
        self.module.to("meta")
        self.weights = None

    @property
    def is_pending(self) -> bool:
        return self.stage is Stage.PENDING

    @property
    def is_offline(self) -> bool:
        return self.stage is Stage.OFFLINE

    @property
    def kind(self) -> str:
        """How it runs: its strategy's name, "offline", or "none" before it is prepared."""
        if self.is_offline:
            return "offline"
        return self.strategy.name if self.strategy is not None else "none"

    def full_state(self) -> dict:
        """Its full state dict as exported: master weights back in the dtype they were loaded in. Every rank calls
        this (a sharded module is gathered to rank 0, the others get {})."""
        state = self.strategy.full_state_dict(self.module) if self.strategy is not None else self.module.state_dict()
        return self.precision.export(state) if self.precision is not None else state

    @property
    def export_dtype(self):
        """The dtype its exports record (its first floating parameter's as loaded), where master weights differ."""
        return self.precision.dtype if self.precision is not None else None

    @property
    def export_dtypes(self) -> dict:
        """Tensor name -> the dtype it is exported in, where master weights differ from it."""
        return dict(self.precision.masters) if self.precision is not None else {}

    def record_source(self, folder: str) -> None:
        """A module with no recorded source takes `folder` (made absolute) as the one its weights come from."""
        if not self.entry.source:
            self.entry.source = os.path.abspath(folder)
