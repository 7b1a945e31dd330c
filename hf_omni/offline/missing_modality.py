"""Batches where some ranks have no input for a module (a text-only batch on one rank, images on another).

A sharded or replicated module runs collectives (FSDP all-gathers in forward, gradient reductions in backward)
that every rank must enter. The module's `@offline_encoder` method is its entry point: every rank calls it at the
same point of `forward`, and a rank with no input passes `None` (or 0 rows) for its inputs. Then, with the modules
prepared over more than one rank:

- every rank first shares which inputs it has, with their shapes and dtypes: before `forward`, in one small
  all-gather for every entry point whose inputs are `forward`'s arguments and every offline module
  (`forward_plan.py`), or at the call for an entry point whose inputs `forward` makes itself;
- where some rank has none, the first rank that has them broadcasts row 0 of each input, and a rank without input
  runs the method on that row, twice (two rows: BatchNorm needs more than one value per channel), and returns the
  output's first 0 rows, still in the graph. The buffers the dummy changed (BatchNorm's running statistics) are
  put back, after forward and again at the end of backward (activation checkpointing runs forward again);
- when no rank has an input, every rank returns `None` (the module is skipped everywhere, as one process would),
  except at the last micro-step of an accumulation window in which the method ran: then every rank runs the
  dummy (on the last row it saw), so the window's gradients are still reduced.

The 0 rows are also added (as `sum()`, which is 0) to the `forward`'s loss (or, without one, to its first output
that needs a gradient), so the module's backward and its gradient reductions run on every rank even when
`forward` drops them; the dummy contributes zero gradients. An offline module (on the meta device, its cached
outputs fed to `forward` instead) runs nothing, but the modules after it do: in the same all-gather before `forward`
every rank shares which cached outputs it was given, and the entry point returns 0 rows shaped like another
rank's outputs.

A `forward` that skips a sharded or replicated module on some ranks without going through the entry point pairs
the ranks' collectives wrongly: with gloo the run aborts on a size mismatch (checked: 4 ranks, vision sharded),
with NCCL it waits until the process group's timeout (`ddp_timeout`) or, where sizes happen to match, exchanges
the wrong tensors. Inputs' first dimension is the sample (as for the offline cache).
"""

from __future__ import annotations

import functools
import inspect
import weakref

import torch

from ..core.dist import rank
from . import exchange, window
from .dummy import PENDING, call_on_dummy, join_to_loss, tensor_output
from .exchange import given, partly_given, wrong_value
from .forward_plan import PLAN, runs_collectives, share_forward
from .ragged import empty_form, items_of
from .spec import class_encoders

CACHED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> {offline module: (shape, dtype) | None}
WINDOW: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> {module: a sample it ran on, this window}


def call_entry_point(model, spec, fn, args: tuple, kwargs: dict):
    """`fn(model, *args, **kwargs)`, the `@offline_encoder` method of module `spec.module`, as described above."""
    if not runs_collectives(model):
        return call_alone(model, spec, fn, args, kwargs)
    try:  # a call this rank cannot bind: the error goes in the call's collective below, which every rank joins
        bound, failure = method_signature(fn).bind(model, *args, **kwargs), None
    except TypeError as err:
        bound, failure = None, f"module {spec.module!r}: {spec.method}: {err}"
    inputs = {column: bound.arguments.get(column) if bound else None for column in spec.inputs}
    present = [c for c, v in inputs.items() if given(v)]
    error = failure or partly_given(spec, inputs)
    if model.slots[spec.module].is_offline:  # ranks given cached outputs never call it: no exchange
        if error is not None:
            raise ValueError(error)
        return fn(*bound.args, **bound.kwargs) if present else cached_rows(model, spec, model.prepared)
    plan, shared, own, deferred = share_call(model, spec, inputs, present, error, failure)
    present = [] if deferred else present  # a problem kept for the window's next agreement: the dummy runs here
    if spec.ragged and not shared.everyone and shared.donor is not None:  # every rank knows the same: all raise
        raise ValueError(f"module {spec.module!r}: {spec.method} returns ragged outputs (items of different "
                         "lengths), so no dummy is built from a row of its inputs, and this batch has them on some "
                         "ranks only: set group_by_modality: true (every global batch agrees on its modalities) or "
                         "serve the module from its offline cache")
    sample = None
    if not shared.everyone:
        source = inputs if present and same_form(inputs, shared.donors) or plan is None else plan.own
        sample = exchange.broadcast_row(shared.donors, shared.donor, source, model.prepared)
    if present:
        in_window(model, spec, {} if spec.ragged else {c: inputs[c][:1].detach().clone() for c in spec.inputs})
        out = fn(*bound.args, **bound.kwargs)
        if spec.ragged:
            items_of(spec, out)  # in its declared form
            return out
        return tensor_output(spec, out)
    return call_on_dummy(model, spec, fn, bound, in_window(model, spec, sample or own))


def call_alone(model, spec, fn, args: tuple, kwargs: dict):
    """No rank waits on this one's collectives: the call as written, or None for a batch without its inputs."""
    bound = method_signature(fn).bind(model, *args, **kwargs)
    inputs = {column: bound.arguments.get(column) for column in spec.inputs}
    if (error := partly_given(spec, inputs)) is not None:
        raise ValueError(error)
    return fn(*bound.args, **bound.kwargs) if any(given(v) for v in inputs.values()) else None


def share_call(model, spec, inputs: dict, present: list, error: str | None, failure: str | None):
    """(the forward's plan or None, what every rank has of the call's inputs, this rank's own first rows when its
    forward dropped its inputs, whether its problem was kept): shared now (a call outside forward, or inputs forward
    made itself) or agreed with the plan shared before forward, every rank raising alike where the call is not as
    planned: at once (one integer per rank), or, inside an accumulation window (no collective at the call), at the
    window's next agreement, this rank running the dummy meanwhile (`window.defer`)."""
    plan, own, deferred = PLAN.get(model, {}).get(spec.method), None, False
    if plan is None:
        shared = exchange.share_inputs({spec.method: inputs}, error or wrong_value(spec.module, spec.method, inputs))
        return plan, shared[spec.method], own, deferred
    shared = plan.shared
    wrong = error is not None or wrong_value(spec.module, spec.method, inputs) or present and shared.donor is None
    problem = failure or (exchange.not_as_planned(spec, present) if wrong else None)
    if not plan.windowed:
        exchange.agree(problem)
    elif problem is not None and failure is None and plan.in_window:
        window.defer(model, f"{problem} (on rank {rank()}, inside an accumulation window)")
        deferred = True
    elif problem is not None:  # a generate call (its outputs would be wrong), or a call this rank cannot bind
        raise ValueError(f"{problem} (on rank {rank()}; its plan was agreed for its accumulation window or "
                         "generate call, so no collective tells the other ranks)")
    if shared.mine and (not present or deferred):  # forward dropped its inputs here: the dummy runs on them
        own = {c: plan.own[c][:1] for c in spec.inputs}
    return plan, shared, own, deferred


@functools.cache
def method_signature(fn) -> inspect.Signature:
    return inspect.signature(fn)


def cached_rows(model, spec, prepared):
    """An offline module's entry point on a rank given no cached outputs: 0 rows shaped like another rank's."""
    if spec.module not in CACHED.get(model, {}):
        raise ValueError(f"module {spec.module!r} is offline: call {spec.method} inside the model's forward")
    row = CACHED[model][spec.module]  # (shape, dtype) of another rank's outputs, or None
    if row is None:
        return None
    if spec.ragged:
        return empty_form(spec, row[0][1:], row[1], prepared.device)
    return torch.empty((0, *row[0][1:]), dtype=row[1], device=prepared.device)


def same_form(inputs: dict, donors: dict) -> bool:
    """Each input has the shared shape after dim 0 and dtype (what the ranks without it allocate)."""
    return all(donors[c] is not None and tuple(v.shape[1:]) == donors[c][0][1:] and v.dtype == donors[c][1]
               for c, v in inputs.items())


def in_window(model, spec, sample):
    """`sample` (what this call runs on; None: nothing), or, when no rank has an input at the last micro-step of an
    accumulation window in which the method ran, the window's last sample: the modules it feeds must still join
    the gradient reduction. The window ends at that step. Every rank decides alike (they call in lockstep)."""
    window = WINDOW.setdefault(model, {})
    if not torch.is_grad_enabled():
        return sample
    if sample is None and model.prepared.syncing:
        sample = window.get(spec.module)
    if model.prepared.syncing:
        window.pop(spec.module, None)
    elif sample is not None:
        window[spec.module] = sample
    return sample


def before_forward(model, args: tuple, kwargs: dict) -> None:
    """Forward pre-hook of `OmniModel`: nothing left from a previous forward (one that raised); then the forward's
    one exchange (`forward_plan.py`), or its answer agreed for its accumulation window (`window.py`): which offline
    modules' cached outputs each rank was given (their entry point's answer on a rank given none), and the inputs of
    the entry points `forward` is given."""
    PENDING.pop(model, None)
    CACHED.pop(model, None)
    PLAN.pop(model, None)
    if not runs_collectives(model):
        return None
    specs = class_encoders(type(model))
    offline = [s for s in specs if model.slots[s.module].is_offline]
    online = [s for s in specs if s not in offline]
    planned = window.take(model, args, kwargs, offline, online)  # agreed for the window or `generate` call, or
    planned = planned if planned is not None else window.in_call(model, args, kwargs, offline, online)  # now
    cached, PLAN[model] = planned if planned is not None else share_forward(model, args, kwargs, offline, online)
    CACHED[model] = {s.module: in_window(model, s, cached[s.module]) for s in offline}  # on every rank alike
    return None


def keep_in_graph(model, args, output):
    """Forward hook of `OmniModel`: the forward's state cleared, and its 0-row outputs joined to its loss
    (`dummy.join_to_loss`)."""
    CACHED.pop(model, None)
    PLAN.pop(model, None)
    pending = PENDING.pop(model, None)
    return join_to_loss(output, pending) if pending else None
