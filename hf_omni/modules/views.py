"""`SlotViews`: what a run decided about each module, read from the slots (`slot.ModuleSlot`) as `OmniPlugin`'s
per-module views, keyed by module name: its resolved settings, whether it trains, how it is wrapped, its FSDP plugin,
its mesh, its offline entry point and its last gradient norm."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:  # annotations only: the settings are the layer above's
    from ..arguments.module import ModuleArguments


class SlotViews:
    """Views over `self.model.slots` (none before a model is seen)."""

    def _slots(self) -> dict:
        model = getattr(self, "model", None)
        return model.slots if model is not None else {}

    @property
    def grad_norms(self) -> dict[str, torch.Tensor]:  # the last step's pre-clip norms, on the device
        return {name: slot.grad_norm for name, slot in self._slots().items() if slot.grad_norm is not None}

    @property
    def module_args(self) -> dict[str, "ModuleArguments"]:
        return {name: slot.args for name, slot in self._slots().items()}

    @property
    def trainable(self) -> list[str]:
        return [name for name, slot in self._slots().items() if slot.trains]

    @property
    def offline(self) -> dict:
        """Module -> its `@offline_encoder` spec (`offline_modules`)."""
        return {name: slot.encoder for name, slot in self._slots().items() if slot.encoder is not None}

    @property
    def wrapped(self) -> dict[str, str]:
        return {name: slot.kind for name, slot in self._slots().items()}

    @property
    def fsdp_plugins(self) -> dict:
        return {slot.strategy.key: slot.strategy.plugin for slot in self._slots().values() if slot.kind == "fsdp"}

    @property
    def meshes(self) -> dict:
        """Module -> its `DeviceMesh` (modules whose strategy takes one; shared between modules of one shape)."""
        return {slot.strategy.key: slot.strategy.mesh for slot in self._slots().values()
                if slot.strategy is not None and slot.strategy.mesh is not None}
