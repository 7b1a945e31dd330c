"""Per-module EMA weights (`modules.<name>.ema`), as diffusers' `EMAModel` keeps them, sharded like the module.

    ModuleEMA(module, settings)   one shadow per trained parameter (requires_grad): `p.detach().clone()`, so a DTensor
                                  parameter under FSDP gets a DTensor shadow with the same placements (this rank's
                                  shard only); frozen parameters (a LoRA base) have none: they never change
    .update()                     after each optimizer step that stepped: the decay from the host step counter
                                  (`EMAModel.get_decay`), then `s.sub_((1 - decay) * (s - p))` per tensor, as
                                  `EMAModel.step` does: local elementwise ops, no collective, no host read
    .swap()                       exchange the parameters' values with the shadows in place, one tensor at a time
                                  (bitwise exact; one tensor of transient memory): FSDP's own storage holds the
                                  EMA values while swapped
    ema_weights(model)            the modules with `export_ema` swapped for the duration (exports, sampling)

The checkpointer saves `shadows` in `state/` with the optimizer shards (DCP) and `state_json()` as `state/ema.json`.
"""

from __future__ import annotations

import contextlib

import torch

from ..core.errors import OmniArgumentError
from ..core.refusals import RESOLVED, refusal

EMA_JSON = "ema.json"
# diffusers.training_utils.EMAModel's fields and defaults (power: 2 / 3, the 0.667)
EMA_DEFAULTS = {"decay": 0.9999, "min_decay": 0.0, "update_after_step": 0, "use_ema_warmup": False,
                "inv_gamma": 1.0, "power": 2 / 3}
_TYPES = {"decay": (int, float), "min_decay": (int, float), "update_after_step": (int,), "use_ema_warmup": (bool,),
          "inv_gamma": (int, float), "power": (int, float)}


def check_ema(module: str | None, settings: dict) -> None:
    """`ema` as written: known fields of the right type (an unknown one names the module and the key)."""
    for name, value in settings.items():
        if name not in EMA_DEFAULTS:
            raise OmniArgumentError(module, f"ema.{name}", f"unknown EMA field; known: {sorted(EMA_DEFAULTS)}")
        if isinstance(value, str) and _TYPES[name] != (bool,):
            try:
                value = float(value)
            except ValueError:
                pass
        if (isinstance(value, bool) and bool not in _TYPES[name]) or not isinstance(value, _TYPES[name]):
            raise OmniArgumentError(module, f"ema.{name}", f"expected {_TYPES[name][-1].__name__}, got {value!r}")
        if name in ("decay", "min_decay") and not 0 <= value <= 1:
            raise OmniArgumentError(module, f"ema.{name}", f"must be in [0, 1], got {value}")
        if name in ("update_after_step", "inv_gamma") and value < 0:
            raise OmniArgumentError(module, f"ema.{name}", f"must be >= 0, got {value}")


class ModuleEMA:
    """One module's EMA: `shadows` (parameter name -> shadow tensor, as this rank holds the parameter) and
    `optimization_step` (the updates so far, as `EMAModel.optimization_step`)."""

    def __init__(self, module: torch.nn.Module, settings: dict | None = None, export: bool = False):
        values = {**EMA_DEFAULTS, **(settings or {})}
        self.decay, self.min_decay = float(values["decay"]), float(values["min_decay"])
        self.update_after_step, self.use_ema_warmup = int(values["update_after_step"]), bool(values["use_ema_warmup"])
        self.inv_gamma, self.power = float(values["inv_gamma"]), float(values["power"])
        self.export = export
        self.params = {name: p for name, p in module.named_parameters() if p.requires_grad}
        with torch.no_grad():
            self.shadows = {name: p.detach().clone() for name, p in self.params.items()}
        self.optimization_step = 0
        self.swapped = False

    def get_decay(self, optimization_step: int) -> float:
        """`EMAModel.get_decay`, on the host."""
        step = max(0, optimization_step - self.update_after_step - 1)
        if step <= 0:
            return 0.0
        if self.use_ema_warmup:
            value = 1 - (1 + step / self.inv_gamma) ** -self.power
        else:
            value = (1 + step) / (10 + step)
        return max(min(value, self.decay), self.min_decay)

    @torch.no_grad()
    def update(self) -> None:
        """One EMA step after an optimizer step (`EMAModel.step`'s arithmetic, tensor by tensor)."""
        if self.swapped:
            raise RuntimeError("EMA update while the EMA weights are swapped in (inside ema_weights)")
        self.optimization_step += 1
        one_minus_decay = 1 - self.get_decay(self.optimization_step)
        for name, param in self.params.items():
            shadow = self.shadows[name]
            shadow.sub_(one_minus_decay * (shadow - param))

    @torch.no_grad()
    def reset(self) -> None:
        """Shadows from the parameters as they are now, counter at 0 (a fresh `EMAModel`: a resume from a
        checkpoint without EMA)."""
        for name, param in self.params.items():
            self.shadows[name].copy_(param)
        self.optimization_step = 0

    @torch.no_grad()
    def swap(self) -> None:
        """Parameters <-> shadows, in place, one tensor at a time (calling it twice restores both bitwise)."""
        for name, param in self.params.items():
            shadow = self.shadows[name]
            tmp = param.detach().clone()
            param.copy_(shadow)
            shadow.copy_(tmp)
            del tmp
        self.swapped = not self.swapped

    def nbytes(self) -> int:
        """Bytes of this rank's shadows (a DTensor's local shard)."""
        return sum(_local(s).numel() * s.element_size() for s in self.shadows.values())

    def state_json(self) -> dict:
        return {"optimization_step": self.optimization_step, "export": self.export,
                "settings": {"decay": self.decay, "min_decay": self.min_decay,
                             "update_after_step": self.update_after_step, "use_ema_warmup": self.use_ema_warmup,
                             "inv_gamma": self.inv_gamma, "power": self.power}}

    def load_json(self, value: dict) -> None:
        self.optimization_step = int(value["optimization_step"])


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def slot_emas(model, export_only: bool = False) -> dict:
    """Module name -> its `ModuleEMA` (those with `export_ema` alone when `export_only`)."""
    slots = getattr(model, "slots", {})
    return {name: slot.ema for name, slot in slots.items()
            if getattr(slot, "ema", None) is not None and (slot.ema.export or not export_only)}


def ema_weights(model, modules=None):
    """The EMA weights in the modules' own parameters for the duration (those with `export_ema`, or `modules`: the
    names to swap), swapped back after, bitwise. Modules swapped already (a nested use) are left to the outer one."""
    emas = slot_emas(model, export_only=modules is None)
    return swapped_in([ema for name, ema in emas.items() if modules is None or name in modules])


def export_weights(slot):
    """One module's export: its EMA weights swapped in for the duration where it has `export_ema`."""
    ema = getattr(slot, "ema", None)
    return swapped_in([ema] if ema is not None and ema.export else [])


@contextlib.contextmanager
def swapped_in(emas: list):
    swapped = [ema for ema in emas if not ema.swapped]
    for ema in swapped:
        ema.swap()
    try:
        yield
    finally:
        for ema in swapped:
            ema.swap()


@refusal(RESOLVED)
def refuse_export_without_ema(model, args) -> None:
    for name, slot in model.slots.items():
        if slot.args.trainable and slot.args.export_ema and slot.args.ema is None:
            raise OmniArgumentError(name, "export_ema", "exports the EMA weights: set `ema` too")
