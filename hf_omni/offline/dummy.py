"""The dummy a rank without input runs (`missing_modality.py`): the module's entry point on two rows of another
rank's input (or its own planned ones), its output's first 0 rows kept in the graph, the buffers it changed put
back; and the forward hook that joins those 0 rows to the forward's loss, so the module's backward and its gradient
reductions run on every rank even when `forward` drops them."""

from __future__ import annotations

import weakref

import torch

from ..compat import queue_backward_callback

PENDING: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> 0-row outputs its forward must keep


def call_on_dummy(model, spec, fn, bound, sample: dict | None):
    """This rank has no input: the method on a dummy of two rows of `sample` (its first 0 rows kept), or None
    where no rank has an input (and no window to close): skipped everywhere."""
    if sample is None:
        return None
    if spec.ragged:  # a window that ran it ends with no input anywhere, and no dummy: every rank raises alike
        raise ValueError(f"module {spec.module!r}: {spec.method} returns ragged outputs and ran earlier in this "
                         "accumulation window, but no rank has its inputs at the window's last micro-step: no dummy "
                         "can join the gradient reduction. Give each window's last micro-batch its inputs, or serve "
                         "the module from its offline cache")
    for column, row in sample.items():
        bound.arguments[column] = torch.cat([row, row]).to(model.prepared.device)
    return dummy_rows(model, spec, fn, bound)


def dummy_rows(model, spec, fn, bound):
    """The method on the dummy; its first 0 rows, joined to the forward's loss. The buffers the dummy changed are
    put back now, and again at the end of backward (to what they were when backward reached the dummy)."""
    touched = [(b, b.detach().clone()) for b in model.slots[spec.module].module.buffers() if not b.is_meta]
    out = tensor_output(spec, fn(*bound.args, **bound.kwargs))
    restore(touched)  # all of its module's buffers, unread: no comparison (a device sync per buffer)
    rows = out[:0]
    if rows.requires_grad and touched:  # activation checkpointing re-runs the dummy's forward in backward

        def at_backward(grad):
            again = [(b, b.detach().clone()) for b, _ in touched]
            queue_backward_callback(lambda: restore(again))

        rows.register_hook(at_backward)
    PENDING.setdefault(model, []).append(rows)
    return rows


def restore(saved: list) -> None:
    """`.data`: no version bump (autograd saved BatchNorm's statistics; training-mode backward uses the batch's)."""
    for buffer, value in saved:
        buffer.data.copy_(value)


def tensor_output(spec, out):
    if not isinstance(out, torch.Tensor) or out.ndim == 0:
        raise ValueError(f"module {spec.module!r}: {spec.method} must return a tensor with one row per input row "
                         f"(a rank without input gets its first 0 rows), got {type(out).__name__}")
    return out


def join_to_loss(output, pending: list):
    """This forward's 0-row outputs joined (adding 0) to its loss, or without one to its first output that needs a
    gradient (logits a `compute_loss_func` reads); a dict, ModelOutput, tuple or tensor. None: `output` as it is."""
    zero = sum(rows.sum() for rows in pending)
    if isinstance(output, torch.Tensor):  # a forward returning its loss
        return output + zero.to(output.dtype) if output.requires_grad and output.is_floating_point() else None
    items = list(output.items()) if isinstance(output, dict) else list(enumerate(output)) \
        if isinstance(output, (tuple, list)) else []
    needs = [k for k, v in items if isinstance(v, torch.Tensor) and v.requires_grad and v.is_floating_point()]
    if not needs:
        return None
    key = "loss" if "loss" in needs else needs[0]
    if isinstance(output, dict):
        output[key] = output[key] + zero.to(output[key].dtype)
        return output
    values = [v + zero.to(v.dtype) if k == key else v for k, v in items]
    return type(output)(*values) if hasattr(output, "_fields") else type(output)(values)  # a namedtuple too
