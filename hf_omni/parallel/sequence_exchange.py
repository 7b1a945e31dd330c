"""The all-to-alls of sequence parallelism (`sequence.py`), each an autograd function whose backward is the reverse
exchange: rows <-> sequence chunks at the module's boundary, sequence chunks <-> heads around each attention
(Ulysses).

Per rank per call, for a tensor of B rows x L positions x W values on N ranks: `to_chunks` sends (N - 1) / N of its
rows' values and receives as many (every rank runs the group's rows on L / N positions); `swap` around attention sends
(N - 1) / N of q, k, v and of the output. Nothing is gathered whole: every exchange is one `all_to_all_single`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def all_to_all_rows(x: torch.Tensor, out_rows: list[int], in_rows: list[int], group) -> torch.Tensor:
    """`all_to_all_single` on dim 0 (uneven splits allowed); bool through uint8 (gloo has no bool)."""
    flag = x.dtype == torch.bool
    x = x.to(torch.uint8) if flag else x
    out = x.new_empty((sum(out_rows), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), out_rows, in_rows, group=group)
    return out.bool() if flag else out


class RowsToChunks(torch.autograd.Function):
    """(B_me, L, ...) -> (B_group, L / N, ...): chunk j of every rank's rows to rank j, the group's rows in rank
    order. `rows`: each rank's row count."""

    @staticmethod
    def forward(ctx, x, group, rows, me):
        ctx.group, ctx.rows, ctx.me = group, rows, me
        n = len(rows)
        chunks = x.unflatten(1, (n, x.shape[1] // n)).transpose(0, 1).flatten(0, 1)  # (N x B_me, L / N, ...)
        return all_to_all_rows(chunks, rows, [rows[me]] * n, group)

    @staticmethod
    def backward(ctx, grad):
        return ChunksToRows.apply(grad, ctx.group, ctx.rows, ctx.me), None, None, None


class ChunksToRows(torch.autograd.Function):
    """The reverse of `RowsToChunks`: (B_group, L / N, ...) -> (B_me, L, ...)."""

    @staticmethod
    def forward(ctx, x, group, rows, me):
        ctx.group, ctx.rows, ctx.me = group, rows, me
        n = len(rows)
        mine = all_to_all_rows(x, [rows[me]] * n, rows, group)  # (N x B_me, L / N, ...), chunk-major
        return mine.unflatten(0, (n, rows[me])).transpose(0, 1).flatten(1, 2)

    @staticmethod
    def backward(ctx, grad):
        return RowsToChunks.apply(grad, ctx.group, ctx.rows, ctx.me), None, None, None


class Swap(torch.autograd.Function):
    """Split `x` into N pieces along `split`, piece j to rank j; the pieces received concatenated along `cat` in rank
    order (Ulysses: heads -> sequence before attention, sequence -> heads after)."""

    @staticmethod
    def forward(ctx, x, group, split: int, cat: int):
        ctx.group, ctx.split, ctx.cat = group, split, cat
        n = dist.get_world_size(group)
        pieces = torch.stack(x.chunk(n, dim=split))  # (N, ...)
        out = all_to_all_rows(pieces, [1] * n, [1] * n, group)
        return torch.cat(out.unbind(0), dim=cat)

    @staticmethod
    def backward(ctx, grad):
        return Swap.apply(grad, ctx.group, ctx.cat, ctx.split), None, None, None
