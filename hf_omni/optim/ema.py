"""Building each trained module's EMA (`modules.<name>.ema`, `modules.ema.ModuleEMA`) and stepping it after every
optimizer step that stepped (`ModuleOptimizers.stepped`: an fp16 step skipped for an inf / nan is no EMA step).

    plugin.build_optimizers -> attach_emas(model, optimizer): slot.ema per trained module with `ema`, and an
    `after_step` callback on the composite optimizer that updates the EMAs of the modules that stepped
"""

from __future__ import annotations

import logging

from ..modules.ema import ModuleEMA

logger = logging.getLogger("hf_omni")


def build_emas(slots: dict) -> dict[str, ModuleEMA]:
    """A fresh EMA (shadows = the parameters now) for every trained module whose arguments set `ema`; none for the
    others (a frozen module has nothing to average)."""
    for slot in slots.values():
        margs = slot.args
        slot.ema = None
        if margs is not None and margs.ema is not None and slot.trains:
            slot.ema = ModuleEMA(slot.module, margs.ema, export=margs.export_ema)
        elif margs is not None and margs.ema is not None:
            logger.info("hf_omni: module %r is frozen: its `ema` is ignored", slot.name)
    return {name: slot.ema for name, slot in slots.items() if slot.ema is not None}


def attach_emas(model, optimizer) -> dict[str, ModuleEMA]:
    """`build_emas`, and the update after each optimizer step of the modules whose optimizer stepped."""
    emas = build_emas(model.slots)
    if emas:
        def update() -> None:
            stepped = optimizer.stepped if optimizer.stepped is not None else set(emas)
            for name in stepped:
                if name in emas:
                    emas[name].update()

        optimizer.after_step.append(update)
    return emas
