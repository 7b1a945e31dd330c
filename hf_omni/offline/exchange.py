"""The missing-modality exchange's collectives (rules in `missing_modality.py`): one all-gather of host metadata
(who has which input, shapes, dtypes, an error) for every entry point a forward plans, or for one entry point at its
call, and the donor's row broadcast where some rank lacks an input."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..core.dist import all_gather_host, checkpoint_group, rank, world_size
from ..core.dtypes import CODES

MAX_DIMS = 8


@dataclass(frozen=True)
class Shared:
    """What every rank knows of one group of columns (an entry point's inputs, or an offline module's output) after
    the exchange, alike on every rank."""

    donors: dict  # column -> (shape, dtype) of the first rank that has it, or None where no rank has it
    donor: int | None  # the first rank that has every column (None: no rank has them all)
    everyone: bool  # every rank has every column
    mine: bool  # this rank has every column


def comm_device(prepared) -> torch.device:
    import torch.distributed as dist

    return torch.device("cpu") if str(dist.get_backend()) == "gloo" else prepared.device


def given(value) -> bool:
    """An input counts as given when it is not None and not 0 rows (a batch without that modality)."""
    return value is not None and not (isinstance(value, torch.Tensor) and value.ndim and not len(value))


def wrong_value(module: str, method: str, values: dict) -> str | None:
    """The problem with the first given value that is no tensor of a known dtype and 1 to MAX_DIMS dims."""
    for column, value in values.items():
        if not given(value):
            continue
        if not isinstance(value, torch.Tensor) or value.dtype not in CODES or not 1 <= value.ndim <= MAX_DIMS:
            return (f"module {module!r}: {column!r} of {method} must be a tensor of 1 to {MAX_DIMS} dims with a dtype "
                    f"in {[str(d) for d in CODES]}, got {getattr(value, 'dtype', type(value).__name__)} "
                    f"{tuple(getattr(value, 'shape', ()))}")
    return None


def partly_given(spec, values: dict) -> str | None:
    """The problem with an entry point's inputs given in part (a sample without a modality passes None for all)."""
    present = [c for c, v in values.items() if given(v)]
    if not present or len(present) == len(values):
        return None
    return (f"module {spec.module!r}: {spec.method} got {present} but None for "
            f"{[c for c in values if c not in present]}; a sample without this modality passes None for every input")


def share_inputs(groups: dict, problem: str | None = None) -> dict:
    """One all-gather of host metadata on hf_omni's gloo side group (`core.dist.all_gather_host`: no device memory is
    read) for every group of columns at once: `groups` is {key: {column: value}} (the same keys and columns on every
    rank), and the answer {key: Shared}. A rank that found its inputs wrong (`problem`) says so in the same
    all-gather, and every rank then raises the same error, naming that rank."""
    group = checkpoint_group()
    everyone = all_gather_host(own_rows(groups, problem), group)  # [rank][row][field], Python ints
    raise_shared(problem, [rows[-1][0] == 1 for rows in everyone], group)
    return read_rows(groups, everyone)


def own_rows(groups: dict, problem: str | None = None) -> list[list[int]]:
    """This rank's rows of the exchange: per column [given, dtype code, ndim, *shape], then one row whose first
    field says whether this rank found a `problem` (then its columns are left at 0)."""
    columns = [value for values in groups.values() for value in values.values()]
    mine = [[0] * (3 + MAX_DIMS) for _ in range(len(columns) + 1)]
    if problem is None:
        for i, value in enumerate(columns):
            if given(value):
                mine[i][:3 + value.ndim] = [1, CODES.index(value.dtype), value.ndim, *value.shape]
    mine[-1][0] = int(problem is not None)
    return mine


def read_rows(groups: dict, everyone: list) -> dict:
    """{key: Shared} from every rank's `own_rows` of `groups` (alike on every rank)."""
    shared, at, me = {}, 0, rank()
    for key, values in groups.items():
        rows = range(at, at + len(values))
        at += len(values)
        has = [all(ranks[i][0] == 1 for i in rows) for ranks in everyone]
        donors = {}
        for i, column in zip(rows, values):
            first = next((r for r, ranks in enumerate(everyone) if ranks[i][0] == 1), None)
            row = None if first is None else everyone[first][i]
            donors[column] = None if row is None else (tuple(row[3:3 + row[2]]), CODES[row[1]])
        shared[key] = Shared(donors, next((r for r, h in enumerate(has) if h), None), all(has), has[me])
    return shared


def raise_shared(problem: str | None, failed: list[bool], group) -> None:
    """Where some rank failed (`failed`, alike on every rank), every rank raises the first failed rank's `problem`
    (the messages follow in one more all-gather, on every rank alike)."""
    import torch.distributed as dist

    if any(failed):
        first, messages = failed.index(True), [None] * world_size()
        dist.all_gather_object(messages, problem, group=group)
        raise ValueError(f"{messages[first]} (on rank {first}; every rank raises this)")


def agree(problem: str | None) -> None:
    """An entry point's call that decides from what was shared before `forward`: one all-gather of one integer per
    rank (whether its call went as planned, `problem` where not), so a rank that cannot go on raises with every
    rank instead of alone (the others would wait in the module's collectives)."""
    group = checkpoint_group()
    raise_shared(problem, [row[0][0] == 1 for row in all_gather_host([[int(problem is not None)]], group)], group)


def not_as_planned(spec, present: list) -> str:
    return (f"module {spec.module!r}: {spec.method} was called on this rank with {present or 'none'} of its inputs "
            f"{list(spec.inputs)}, unlike forward's arguments of those names, which every rank shared before forward "
            "ran (and which decide where the module runs). forward must pass them on as it was given them (cast or "
            "moved, but given where given and None where not); name an input forward makes itself unlike its "
            "arguments, and it is shared at the call instead")


def broadcast_row(donors: dict, donor_rank: int | None, inputs: dict, prepared) -> dict | None:
    """Row 0 of each input of the first rank that has them, on every rank (one broadcast per input). The donor
    sends `inputs`' row where it has the shared form (shape after dim 0, dtype)."""
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
