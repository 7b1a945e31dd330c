"""The JSON half of a module's optimizer state (`optimizer.json`): param groups, non-tensor per-parameter values and
one-element tensors as numbers, and their way back into the types the live optimizer holds."""

from __future__ import annotations

import json

import torch


def json_value(value, where: str):
    """A param-group or per-parameter value as JSON: tuples become lists, one-element tensors numbers."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise TypeError(f"{where}: a tensor of shape {tuple(value.shape)} outside the per-parameter state "
                            "cannot be saved")
        return value.item()
    if isinstance(value, tuple):
        return [json_value(v, where) for v in value]
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        raise TypeError(f"{where}: {type(value).__name__} value {value!r} is not JSON") from None
    return value


def like(value, template):
    """A JSON value back in the type the live optimizer holds at that place."""
    if isinstance(template, torch.Tensor):  # its shape too: a one-element moment of a (1,) parameter stays (1,)
        return torch.tensor(value, dtype=template.dtype, device=template.device).reshape(template.shape)
    if isinstance(template, tuple):
        return tuple(like(v, t) for v, t in zip(value, template))
    return value


def _scalar(value) -> bool:
    """A one-element tensor held whole (AdamW's `step`): kept in the JSON, not in the shards, where DCP would store
    each in one rank's file and every rank would open every other rank's files at resume to read them."""
    return isinstance(value, torch.Tensor) and not hasattr(value, "placements") and value.numel() == 1 and \
        not value.is_complex()


def _numbers(state: dict) -> dict:
    """The one-element tensors of a per-parameter state as numbers, exactly (floats through float64, integers and
    booleans through int64), in one copy to the host per kind."""
    found = [(fqn, k, v) for fqn, s in state.items() for k, v in s.items() if _scalar(v)]
    numbers = {}
    for floating, dtype in ((True, torch.float64), (False, torch.int64)):
        group = [(fqn, k, v) for fqn, k, v in found if v.is_floating_point() == floating]
        if group:
            values = torch.cat([v.detach().reshape(1).to("cpu", dtype) for _, _, v in group]).tolist()
            numbers.update(((fqn, k), number) for (fqn, k, _), number in zip(group, values))
    return numbers


def split(optim_state: dict, where: str) -> tuple[dict, dict]:
    """(per-parameter tensors for the shards, JSON for the rest: one-element tensors as numbers) of
    `get_optimizer_state_dict`'s output."""
    numbers = _numbers(optim_state["state"])
    tensors = {fqn: {k: v for k, v in s.items() if isinstance(v, torch.Tensor) and not _scalar(v)}
               for fqn, s in optim_state["state"].items()}
    scalars = {fqn: {k: numbers[(fqn, k)] if _scalar(v) else json_value(v, f"{where}: optimizer state {fqn}.{k}")
                     for k, v in s.items() if not isinstance(v, torch.Tensor) or _scalar(v)}
               for fqn, s in optim_state["state"].items()}
    groups = [{k: (v if k == "params" else json_value(v, f"{where}: param group {i} {k!r}")) for k, v in g.items()}
              for i, g in enumerate(optim_state["param_groups"])]
    return tensors, {"state": scalars, "param_groups": groups}
