"""One exchange before a forward for all of a composed model's entry points (rules: `missing_modality.py`).

Before `forward` runs (OmniModel's forward pre-hook), every rank shares in one all-gather of host integers:
- for each offline module, which of its cached outputs the rank was given (shapes, dtypes);
- for each entry point whose inputs are all arguments of `forward` by name (the README's
  `encode_image(pixel_values)` called from `forward(..., pixel_values=None, ...)`), which of them it was given, their
  shapes and dtypes, and whether they are wrong (given in part, not a tensor): then every rank raises alike, before
  any module runs.
Such an entry point decides from that answer. Its contract: `forward` passes those arguments on as it was given
them (cast, moved or reshaped, but given where given and None where not). At its call the ranks agree that it went
as planned (one all-gather of one integer per rank: a rank whose call did not, `exchange.not_as_planned`, raises
with every rank), and the donor's row is broadcast in a step where some ranks lack its inputs. An entry point whose
inputs `forward` makes itself (named unlike its arguments, or called outside `forward`) shares them at its call
instead: one more all-gather. Every error a rank finds on its own in the exchange (a `forward` or entry point it
cannot bind, inputs given in part or not tensors, a call unlike the plan) travels in one of these collectives: every
rank raises it, naming that rank, instead of one rank raising while the others wait in the module's collectives.
The forwards of an accumulation window, and those of a `generate` call, share this once for all (`window.py`).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import weakref
from dataclasses import dataclass

from ..core.dist import world_size
from . import exchange
from .ragged import stand_in

PLAN: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> {entry point: Planned}, this forward's


@dataclass(frozen=True)
class Planned:
    """An entry point's inputs as every rank shared them before `forward`, and this rank's own (its dummy's row when
    `forward` does not pass them on)."""

    shared: exchange.Shared
    own: dict
    windowed: bool = False  # agreed with its accumulation window or generate call (`window.py`): no agreement at the
    # call; a problem there is kept for the window's next agreement (`window.defer`) when `in_window`
    in_window: bool = False

    def agreed(self, in_window: bool = False) -> "Planned":
        return dataclasses.replace(self, windowed=True, in_window=in_window)


def runs_collectives(model) -> bool:
    """Prepared over more than one rank with some module sharded or replicated: every rank must call the module."""
    prepared = getattr(model, "prepared", None)
    return prepared is not None and world_size() > 1 and any(
        slot.strategy is not None and slot.strategy.collective for slot in model.slots.values())


@functools.cache
def forward_signature(function) -> tuple[inspect.Signature, frozenset]:
    """`forward`'s signature (its first parameter `self`) and the names it takes one by one."""
    signature = inspect.signature(function)
    kinds = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    return signature, frozenset(n for n, p in signature.parameters.items() if p.kind not in kinds)


def forward_arguments(model, args: tuple, kwargs: dict) -> tuple[dict, frozenset]:
    """The arguments `forward` was called with, by name (`**kw` ones too), and the names it takes one by one."""
    function = getattr(type(model).forward, "__wrapped__", type(model).forward)
    signature, named = forward_signature(function)
    arguments = signature.bind_partial(model, *args, **kwargs).arguments
    extra = next((arguments.pop(n) for n, p in signature.parameters.items()
                  if p.kind is p.VAR_KEYWORD and n in arguments), {})
    return {**extra, **arguments}, named


def share_forward(model, args: tuple, kwargs: dict, offline: list, online: list) -> tuple[dict, dict]:
    """The one all-gather: {offline module: (shape, dtype) of another rank's cached output, or None} and {entry
    point: Planned} for the online entry points whose inputs are all `forward`'s arguments."""
    groups, problem, planned = forward_groups(model, args, kwargs, offline, online)
    if not groups:
        return {}, {}
    return read_plan(exchange.share_inputs(groups, problem), groups, offline, planned)


def forward_groups(model, args: tuple, kwargs: dict, offline: list, online: list) -> tuple[dict, str | None, list]:
    """What a forward called with `args` / `kwargs` shares: {key: {column: value}} (empty: nothing to share), the
    problem this rank found in them (None: none), and the planned entry points."""
    function = getattr(type(model).forward, "__wrapped__", type(model).forward)
    planned = [s for s in online if set(s.inputs) <= forward_signature(function)[1]]  # alike on every rank
    if not offline and not planned:
        return {}, None, []
    groups, problem = {}, None
    try:  # whatever fails here fails in the all-gather, on every rank alike
        arguments = forward_arguments(model, args, kwargs)[0]
    except TypeError as err:
        arguments, problem = {}, f"{type(model).__name__}.forward: {err}"
    for spec in offline:
        value = arguments.get(spec.output)
        groups["output", spec.module] = {spec.output: stand_in(spec, value) if spec.ragged else value}
        problem = problem or exchange.wrong_value(spec.module, "forward", groups["output", spec.module])
    for spec in planned:
        values = groups["inputs", spec.method] = {c: arguments.get(c) for c in spec.inputs}
        problem = problem or exchange.partly_given(spec, values) or exchange.wrong_value(spec.module, spec.method,
                                                                                          values)
    return groups, problem, planned


def read_plan(shared: dict, groups: dict, offline: list, planned: list) -> tuple[dict, dict]:
    """`share_forward`'s answer from the exchange's {key: Shared} of `groups`."""
    cached = {s.module: shared["output", s.module].donors[s.output] for s in offline}
    return cached, {s.method: Planned(shared["inputs", s.method], groups["inputs", s.method]) for s in planned}
