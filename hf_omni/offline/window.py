"""The missing-modality exchange once per optimizer step: the batches of an accumulation window agreed in one
all-gather before the first of them runs (the rules of the exchange are in `missing_modality.py`).

`agree_window(model, batches, size)` shares, for each of the window's batches, what `forward` called with it would
share before it runs (`forward_plan.py`: which offline modules' cached outputs it carries, the inputs of the entry
points that are `forward`'s arguments, shapes and dtypes): one all-gather of host integers on hf_omni's gloo side
group, `size` batches a rank (every rank passes the same `size`; a rank with fewer batches pads). The answers are
queued in the window's order. OmniTrainer agrees each window in `get_batch_samples` and opens a turn per batch in
`training_step`; a loop over `OmniPlugin` calls `plugin.agree_window(batches)`.

A forward takes the head of the queue (no collective) when all of these hold, on its own rank: gradients are
enabled and the model is in training mode; under turns, it is the first forward of its batch's training step;
and what it would share (given or not, shape and dtype of each of those inputs) equals what its rank shared for
that batch. Otherwise it runs its own exchange, as a forward outside a window does (evaluation, `generate`, a call
of the model with other inputs); under turns, the batch's queued answer is then dropped, never given to a later
forward. The answer a forward takes is every rank's for the same batch (all ranks go through the window in the same
order), so the plan is the one the per-forward exchange would have made. Where an entry point is then called unlike
the plan (`exchange.not_as_planned`), no collective at the call could tell the other ranks: that rank keeps the
problem (`defer`), runs the call's dummy so that every collective of the step is joined, and every rank raises it
at the window's next agreement (a flag in its all-gather), before a checkpoint of the step is written
(`ModuleCheckpointer.save`), or at the run's end (`close_windows`, from `OmniPlugin.close`). A call that rank cannot
bind raises at once. A window in which any rank found a batch wrong (an input given in part, a forward it cannot
bind) queues nothing: each forward's own exchange then raises the error on every rank, as without a window.

`generate` of an OmniModel subclass (`GenerationMixin`) calls `forward` once per token; its forwards exchange twice
per call (`one_call`): at the prefill and at the first decoding step (where transformers drops `pixel_values` and
the other inputs `MULTIMODAL_INPUTS_TO_DROP_OUTSIDE_PREFILL` names, on every rank alike), and every later forward
of the call takes the first decoding step's answer. Those later forwards must be given what the first decoding
step was (given or not, shapes, dtypes of the shared inputs), as transformers' own `prepare_inputs_for_generation`
does; a rank whose forward is not raises at once (no collective tells the others, as above).
"""

from __future__ import annotations

import functools
import weakref
from dataclasses import dataclass

import torch

from ..core.dist import all_gather_host, checkpoint_group, rank
from . import exchange
from .forward_plan import forward_groups, read_plan, runs_collectives
from .spec import class_encoders

QUEUE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> Window
DEFERRED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> this rank's first problem in a window
CALLS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> Call, while its `generate` runs


@dataclass
class Window:
    """The agreed answers of a window's batches, in order: (this rank's rows for the batch, {key: Shared})."""

    answers: list
    turns: bool  # True: each answer belongs to one training step (`begin_turn`), taken by its first forward only
    current: tuple | None = None  # under turns: the answer of the training step now running


def split_specs(model) -> tuple[list, list]:
    specs = class_encoders(type(model))
    offline = [s for s in specs if model.slots[s.module].is_offline]
    return offline, [s for s in specs if s not in offline]


def agree_window(model, batches: list, size: int | None = None, turns: bool = False) -> bool:
    """Agree the exchange of `batches` (the keyword arguments of the window's forwards, in order) in one all-gather;
    True when the window's answers were queued. `size`: the number of batches every rank passes (default: its own
    count, which must then be the same on every rank)."""
    QUEUE.pop(model, None)
    if not runs_collectives(model) or not batches:
        return False
    size = len(batches) if size is None else size
    offline, online = split_specs(model)
    entries, problem = [], None
    for batch in batches:
        groups, found, _ = forward_groups(model, (), dict(batch), offline, online)
        if not groups:  # nothing to share (the same on every rank: it depends on the class and its offline modules)
            return False
        entries.append(groups)
        problem = problem or found
    rows = [exchange.own_rows(groups) for groups in entries]
    width, height = len(rows[0][0]), len(rows[0]) - 1  # sent without each batch's error row: the window's is first
    table = [[int(problem is not None), len(batches), int(model in DEFERRED)] + [0] * (width - 3)]
    for k in range(size):
        table += rows[k][:height] if k < len(rows) else [[0] * width for _ in range(height)]
    everyone = all_gather_host(table, checkpoint_group())
    raise_deferred(model, [ranks[0][2] for ranks in everyone])
    if any(ranks[0][0] or ranks[0][1] != len(batches) for ranks in everyone):
        return False  # every rank alike: each forward exchanges on its own (and raises the error there)
    answers = []
    for k, groups in enumerate(entries):
        at = 1 + k * height
        answers.append((rows[k], exchange.read_rows(groups, [ranks[at:at + height] for ranks in everyone])))
    QUEUE[model] = Window(answers, turns)
    return True


def defer(model, problem: str) -> None:
    """A call unlike its window's plan, found on this rank alone: kept (the first one) until the window's next
    agreement or the run's end (`close_windows`), where every rank raises it; the rank runs the call's dummy
    meanwhile, so every collective of the step is joined."""
    DEFERRED.setdefault(model, problem)


def deferred_problem(model) -> str | None:
    return DEFERRED.get(model)


def raise_deferred(model, flags: list[int]) -> None:
    """Every rank alike, after an agreement that carried each rank's flag: when a rank kept a problem, its text goes
    to every rank (one all-gather of objects on the side group, on this path only) and all raise it."""
    if not any(flags):
        return
    import torch.distributed as dist

    problems = [None] * len(flags)
    dist.all_gather_object(problems, DEFERRED.pop(model, None), group=checkpoint_group())
    first = next(p for p in problems if p)
    raise ValueError(f"{first}; every rank raises this at the window's next agreement")


def close_windows(model) -> None:
    """The run's end: a problem kept since the last window's agreement is raised by every rank (one all-gather)."""
    if runs_collectives(model):
        everyone = all_gather_host([[int(model in DEFERRED)]], checkpoint_group())
        raise_deferred(model, [ranks[0][0] for ranks in everyone])


def begin_turn(model) -> None:
    """A training step of a window agreed with turns starts: the next answer is its batch's."""
    window = QUEUE.get(model)
    if window is not None and window.turns:
        window.current = window.answers.pop(0) if window.answers else None


def take(model, args: tuple, kwargs: dict, offline: list, online: list) -> tuple[dict, dict] | None:
    """The forward's plan from the agreed window (see above), or None: it runs its own exchange."""
    window = QUEUE.get(model)
    if window is None or not torch.is_grad_enabled() or not model.training:
        return None
    if window.turns:
        answer, window.current = window.current, None
    else:
        answer = window.answers[0] if window.answers else None
    if answer is None:
        return None
    groups, problem, planned = forward_groups(model, args, kwargs, offline, online)
    if exchange.own_rows(groups, problem) != answer[0]:
        return None
    if not window.turns:
        window.answers.pop(0)
    cached, plans = read_plan(answer[1], groups, offline, planned)
    return cached, {method: plan.agreed(in_window=True) for method, plan in plans.items()}


@dataclass
class Call:
    """A `generate` call: its forwards so far, and the answer of its latest exchange (this rank's rows, {key:
    Shared})."""

    forwards: int = 0
    answer: tuple | None = None
    exchanges: int = 0


def one_call(generate):
    """`generate` with its forwards' exchanges agreed once per call (see above); a nested call joins the outer."""
    if getattr(generate, "exchange_per_call", False):
        return generate

    @functools.wraps(generate)
    def wrapped(self, *args, **kwargs):
        if self in CALLS:
            return generate(self, *args, **kwargs)
        CALLS[self] = Call()
        try:
            return generate(self, *args, **kwargs)
        finally:
            CALLS.pop(self, None)

    wrapped.exchange_per_call = True
    return wrapped


def in_call(model, args: tuple, kwargs: dict, offline: list, online: list) -> tuple[dict, dict] | None:
    """A forward inside `generate`: its plan, exchanged now (the call's first two forwards) or the first decoding
    step's; None outside `generate`."""
    call = CALLS.get(model)
    if call is None:
        return None
    groups, problem, planned = forward_groups(model, args, kwargs, offline, online)
    if not groups:
        return {}, {}
    index, rows = call.forwards, exchange.own_rows(groups, problem)
    call.forwards += 1
    if index < 2 or call.answer is None:
        shared = exchange.share_inputs(groups, problem)  # a problem raises here, on every rank
        call.answer, call.exchanges = (rows, shared), call.exchanges + 1
        return read_plan(shared, groups, offline, planned)
    if rows != call.answer[0]:
        raise ValueError(f"{type(model).__name__}.generate: forward {index} of this call on rank {rank()} was given "
                         "the entry points' inputs unlike its first decoding step (which inputs are given, their "
                         "shapes, dtypes); the exchange is agreed at the prefill and the first decoding step, and no "
                         "collective tells the other ranks")
    cached, plans = read_plan(call.answer[1], groups, offline, planned)
    return cached, {method: plan.agreed() for method, plan in plans.items()}
