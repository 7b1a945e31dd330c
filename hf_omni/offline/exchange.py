"""The missing-modality exchange's collectives (rules in `missing_modality.py`): one all-gather of host metadata
per entry-point call (who has which input, shapes, dtypes, an error), and the donor's row broadcast where some
rank lacks the input."""

from __future__ import annotations

import torch

from ..dist import world_size
from ..dtypes import CODES

MAX_DIMS = 8


def comm_device(prepared) -> torch.device:
    import torch.distributed as dist

    return torch.device("cpu") if str(dist.get_backend()) == "gloo" else prepared.device


def shared_shapes(module: str, method: str, values: dict, error: Exception | None = None
                  ) -> tuple[dict, int | None, bool]:
    """One all-gather of host metadata on hf_omni's gloo side group (`dist.all_gather_host`: no device memory is
    read): per column, the shape and dtype of the first rank that has a value for it (or None); that rank; and
    whether every rank has every value. A rank whose inputs are wrong (`error`, or a value that is no tensor of a
    known dtype) says so in the same all-gather, and every rank then raises the same error, naming the module and
    that rank."""
    import torch.distributed as dist

    from ..dist import all_gather_host, checkpoint_group

    problem = None if error is None else str(error)
    mine = [[0] * (3 + MAX_DIMS) for _ in range(len(values) + 1)]  # the last row: this rank's error flag
    for i, (column, value) in enumerate(values.items()):
        if problem is not None:
            break
        if value is None or (isinstance(value, torch.Tensor) and not len(value)):
            continue
        if not isinstance(value, torch.Tensor) or value.dtype not in CODES or not 1 <= value.ndim <= MAX_DIMS:
            problem = (f"module {module!r}: {column!r} of {method} must be a tensor of 1 to {MAX_DIMS} dims with a "
                       f"dtype in {[str(d) for d in CODES]}, got {getattr(value, 'dtype', type(value).__name__)} "
                       f"{tuple(getattr(value, 'shape', ()))}")
            break
        mine[i][:3 + value.ndim] = [1, CODES.index(value.dtype), value.ndim, *value.shape]
    mine[-1][0] = int(problem is not None)
    group = checkpoint_group()
    everyone = all_gather_host(mine, group)  # [rank][row][field], Python ints
    failed = [r for r, rows in enumerate(everyone) if rows[-1][0] == 1]
    if failed:  # every rank knows: the messages follow, on every rank alike
        messages = [None] * world_size()
        dist.all_gather_object(messages, problem, group=group)
        raise ValueError(f"{messages[failed[0]]} (on rank {failed[0]}; every rank raises this)")
    have = [[row[0] == 1 for row in rows[:-1]] for rows in everyone]
    donors = {column: None for column in values}
    for i, column in enumerate(values):
        first = next((r for r, has in enumerate(have) if has[i]), None)
        if first is not None:
            row = everyone[first][i]
            donors[column] = (tuple(row[3:3 + row[2]]), CODES[row[1]])
    ranks = [r for r, has in enumerate(have) if all(has)]
    return donors, (ranks[0] if ranks else None), all(all(has) for has in have)


def broadcast_row(donors: dict, donor_rank: int | None, inputs: dict, prepared) -> dict | None:
    """Row 0 of each input of the first rank that has them, on every rank (one broadcast per input)."""
    import torch.distributed as dist

    if donor_rank is None:
        return None
    device, rows = comm_device(prepared), {}
    for column, (shape, dtype) in donors.items():
        if dist.get_rank() == donor_rank:
            row = inputs[column][:1].to(device).contiguous()
        else:
            row = torch.empty((1, *shape[1:]), dtype=dtype, device=device)
        dist.broadcast(row, src=donor_rank)
        rows[column] = row
    return rows
