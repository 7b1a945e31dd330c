"""Refusals registered by the feature they protect, run before any compute at two points: once every module's
settings are resolved against the model (`RESOLVED`: `OmniPlugin.resolve`), and once freezing and LoRA are applied
(`TUNED`). Each is a function `(model, args)` (`args`: the run's `OmniTrainingArguments`; each module's resolved
settings are `model.slots[name].args`) that raises `OmniArgumentError` naming the module and key.

    @refusal(RESOLVED)
    def refuse_my_feature(model, args): ...

The feature's own file registers it; whoever runs a stage (`refuse(stage, model, args)`) names none of them."""

from __future__ import annotations

from typing import Callable

RESOLVED, TUNED = "resolved", "tuned"
REFUSALS: dict[str, list[Callable]] = {RESOLVED: [], TUNED: []}


def refusal(stage: str):
    """Register a refusal for `stage` (a decorator); returns the function."""
    if stage not in REFUSALS:
        raise ValueError(f"refusal: no stage {stage!r}; stages: {list(REFUSALS)}")

    def add(function: Callable) -> Callable:
        if function not in REFUSALS[stage]:
            REFUSALS[stage].append(function)
        return function

    return add


def refuse(stage: str, model, args) -> None:
    """Every refusal registered for `stage`, in the order they were registered."""
    for function in REFUSALS[stage]:
        function(model, args)
