"""Batches where some ranks have no input for a module (a text-only batch on one rank, images on another).

A sharded or replicated module runs collectives (FSDP all-gathers in forward, gradient reductions in backward)
that every rank must enter. The module's `@offline_encoder` method is its entry point: every rank calls it at the
same point of `forward`, and a rank with no input passes `None` for its inputs. Then, with the modules prepared
over more than one rank:

- every rank first shares which inputs it has, with their shapes and dtypes (one small all-gather);
- a rank with no input runs the method on a one-row dummy (zeros, each input's shape and dtype from the first rank
  that has one: it works at the very first step) and returns the output's first 0 rows, still in the graph; the
  buffers the dummy changed (BatchNorm's running statistics) are put back;
- when no rank has an input, every rank returns `None` (the module is skipped everywhere, as one process would).

The 0 rows are also added (as `sum()`, which is 0) to the `loss` of the `forward` that called the method, so the
module's backward, and its gradient reductions, run on every rank even when `forward` drops them; the dummy
contributes zero gradients. An offline module (on the meta device, its cached outputs fed to `forward` instead)
runs nothing, but the modules after it do: before `forward`, every rank shares which cached outputs it was given,
and the entry point returns 0 rows shaped like another rank's outputs, or `None` when no rank has any.

A `forward` that skips a sharded or replicated module on some ranks without going through the entry point pairs
the ranks' collectives wrongly: with gloo the run aborts on a size mismatch (checked: 4 ranks, vision sharded),
with NCCL it waits until the process group's timeout (`ddp_timeout`) or, where sizes happen to match, exchanges
the wrong tensors.
"""

from __future__ import annotations

import functools
import inspect
import weakref

import torch

from .dist import world_size
from .offline import OfflineEncoder, is_released

DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.int16,
          torch.int8, torch.uint8, torch.bool)
MAX_DIMS = 8
PENDING: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> 0-row outputs its forward must keep
CACHED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> {offline module: donor shape or None}


def call_entry_point(model, spec, fn, args: tuple, kwargs: dict):
    """`fn(model, *args, **kwargs)`, the `@offline_encoder` method of module `spec.module`, as described above."""
    bound = inspect.signature(fn).bind(model, *args, **kwargs)
    inputs = {column: bound.arguments.get(column) for column in spec.inputs}
    present = [column for column, value in inputs.items() if value is not None]
    if present and len(present) != len(inputs):
        raise ValueError(f"module {spec.module!r}: {spec.method} got {present} but None for "
                         f"{[c for c in inputs if c not in present]}; a sample without this modality passes None "
                         "for every input")
    if not runs_collectives(model):
        return fn(*bound.args, **bound.kwargs) if present else None
    if not present and is_released(getattr(model, spec.module)):  # offline: other ranks were given cached outputs
        cached = CACHED.get(model, {})
        if spec.module not in cached:
            raise ValueError(f"module {spec.module!r} is offline: call {spec.method} inside the model's forward")
        row = cached[spec.module]
        return None if row is None else torch.empty((0, *row[0][1:]), dtype=row[1], device=model_device(model))
    donors = shared_shapes(spec.module, spec.method, inputs)  # every rank, with its inputs or without
    if present:
        return fn(*bound.args, **bound.kwargs)
    if all(donor is None for donor in donors.values()):  # no rank has an input: skipped everywhere
        return None
    device = model_device(model)
    for column, (shape, dtype) in donors.items():
        bound.arguments[column] = torch.zeros((1, *shape[1:]), dtype=dtype, device=device)
    buffers = [(b, b.detach().clone()) for b in model.buffers() if not b.is_meta]
    out = fn(*bound.args, **bound.kwargs)
    for buffer, before in buffers:  # BatchNorm's running statistics never see the dummy; `.data`: no version bump
        buffer.data.copy_(before)  # (autograd saved them; backward in training mode uses the batch's own)
    if not isinstance(out, torch.Tensor) or out.ndim == 0:
        raise ValueError(f"module {spec.module!r}: {spec.method} must return a tensor with one row per input row "
                         f"(a rank without input returns its first 0 rows), got {type(out).__name__}")
    PENDING.setdefault(model, []).append(out[:0])
    return out[:0]


def runs_collectives(model) -> bool:
    """Prepared over more than one rank with some module sharded or replicated: every rank must call the module."""
    prepared = getattr(model, "prepared", None)
    return prepared is not None and world_size() > 1 and any(k != "none" for k in prepared.wrapped.values())


def model_device(model) -> torch.device:
    for tensor in model.parameters():
        if not tensor.is_meta:
            return tensor.device
    return torch.device("cpu")


def shared_shapes(module: str, method: str, values: dict) -> dict:
    """Per column: the shape and dtype of the first rank that has a value for it, or None (one all-gather)."""
    import torch.distributed as dist

    mine = torch.zeros(len(values), 3 + MAX_DIMS, dtype=torch.int64)
    for i, (column, value) in enumerate(values.items()):
        if value is None:
            continue
        if not isinstance(value, torch.Tensor) or value.dtype not in DTYPES or not 1 <= value.ndim <= MAX_DIMS:
            raise ValueError(f"module {module!r}: {column!r} of {method} must be a tensor of 1 to {MAX_DIMS} dims "
                             f"with a dtype in {[str(d) for d in DTYPES]}, got "
                             f"{getattr(value, 'dtype', type(value).__name__)} {tuple(getattr(value, 'shape', ()))}")
        mine[i, :3] = torch.tensor([1, DTYPES.index(value.dtype), value.ndim])
        mine[i, 3:3 + value.ndim] = torch.tensor(value.shape)
    device = torch.device("cuda", torch.cuda.current_device()) if "nccl" in str(dist.get_backend()) else "cpu"
    everyone = torch.empty(world_size() * len(values), 3 + MAX_DIMS, dtype=torch.int64, device=device)
    dist.all_gather_into_tensor(everyone, mine.to(device))
    everyone = everyone.cpu().view(world_size(), len(values), -1)
    donors = {}
    for i, column in enumerate(values):
        rows = [rank_rows[i] for rank_rows in everyone if rank_rows[i, 0] == 1]
        donors[column] = (tuple(rows[0][3:3 + rows[0][2]].tolist()), DTYPES[rows[0][1]]) if rows else None
    return donors


def share_cached_outputs(model, args: tuple, kwargs: dict) -> None:
    """Forward pre-hook of `OmniModel`: which offline modules' cached outputs each rank was given (their entry
    point's answer on a rank that was given none)."""
    if not runs_collectives(model):
        return None
    specs = [s for s in class_encoders(type(model)) if is_released(getattr(model, s.module))]
    if specs:
        given = inspect.signature(model.forward).bind_partial(*args, **kwargs).arguments
        values = {s.output: kwargs.get(s.output, given.get(s.output)) for s in specs}
        donors = shared_shapes(", ".join(s.module for s in specs), "forward", values)
        CACHED[model] = {s.module: donors[s.output] for s in specs}
    return None


@functools.cache
def class_encoders(cls) -> tuple:
    """The `@offline_encoder` specs a model class declares (looked up once per class)."""
    return tuple(spec for name in dir(cls) if isinstance(spec := getattr(getattr(cls, name, None), "offline_encoder",
                                                                         None), OfflineEncoder))


def keep_in_graph(model, args, output):
    """Forward hook of `OmniModel`: the 0-row outputs of this forward's entry points join its `loss` (adding 0)."""
    CACHED.pop(model, None)
    pending = PENDING.pop(model, None)
    if not pending or not isinstance(output, dict) or output.get("loss") is None:
        return None
    output["loss"] = output["loss"] + sum(rows.sum() for rows in pending).to(output["loss"].dtype)
    return output
