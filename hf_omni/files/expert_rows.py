"""This rank's rows of a tensor transformers fuses on load, read from a plain HF folder: MoE experts saved one file
tensor per expert (`experts.<e>.w1.weight`, `.w3.`, `.w2.`) and stacked on load (`experts.gate_up_proj`,
`experts.down_proj`), without the full CPU copy of the module that `weights.read_through_transformers` makes.

How the files map onto a row (one expert) is traced, not written down per model: transformers' own save-time
conversion (`folder_plan.weights_keys`) runs on a probe of ONE row whose elements hold their own positions; what
comes out under each key of row 0 says where that file tensor's elements go in the row. The keys of row e are those
of row 0 with the row index replaced, checked against every key the plan expects. A rank then reads, for each row
it holds, that row's file tensors only (whole: they are that row's alone) and places them. A conversion that does
not act row by row (its keys do not follow the rows, or the positions are not a permutation of the row) is left to
transformers' loading. Costs while tracing: one row of positions (int32) per fused tensor. A tensor sharded on
another dim than the rows (`Shard(1)`, ...: experts over more ranks than experts) reads only its box of each file
tensor where the file tensors are slabs of a row (Mixtral's, Qwen2-MoE's); else it reads each row's file tensors
whole and holds one whole row while placing its box of that row.
"""

from __future__ import annotations

import torch
from torch import nn

from ..shards.box import local_box, local_of
from ..shards.replicas import read_once
from .folder_plan import FolderPlan, plan_folder, weights_keys
from .lora_base import weights_folder
from .safetensors_index import SafetensorsIndex
from .saved_keys import module_tensors

Placement = tuple[int, int] | torch.Tensor  # (first position, count) of a contiguous run, or every position


def _placement(ids: torch.Tensor) -> Placement:
    flat = ids.reshape(-1)
    start = int(flat[0]) if flat.numel() else 0
    if torch.equal(flat, torch.arange(start, start + flat.numel(), dtype=flat.dtype)):
        return start, flat.numel()
    return flat.clone()


def row_layout(module: nn.Module, plan: FolderPlan, source: str) -> tuple[int, dict[str, Placement]] | None:
    """(the index of the key segment that names the row, {key of row 0: its placement in a row}) of the fused
    tensor `source`, or None when its conversion does not act row by row."""
    groups = [i for i, (kind, sources) in enumerate(plan.groups) if sources == [source]]
    tensor = dict(module.named_parameters()).get(source)
    if len(groups) != 1 or tensor is None or tensor.ndim < 2:
        return None
    expected = {e.key: e.shape for e in plan.entries if e.group == groups[0]}
    row = tensor.shape[1:]
    numel = row.numel()
    dtype = torch.int32 if numel < 2**31 else torch.int64
    probe = torch.arange(numel, dtype=dtype).reshape(1, *row)
    out = weights_keys(module, {key: probe for key in plan.aliases.get(source, [])})
    rows, segment = tensor.shape[0], None
    for key in out:
        parts = key.split(".")
        found = [i for i, p in enumerate(parts) if p == "0" and all(
            ".".join(parts[:i] + [str(e)] + parts[i + 1:]) in expected for e in range(rows))]
        if len(found) != 1 or segment not in (None, found[0]):
            return None
        segment = found[0]
    if segment is None or len(out) * rows != len(expected):
        return None
    for key, ids in out.items():
        if tuple(ids.shape) != tuple(expected[key]):
            return None
    every = torch.cat([ids.reshape(-1) for ids in out.values()]) if out else torch.empty(0, dtype=dtype)
    if every.numel() != numel or not torch.equal(every.sort().values, torch.arange(numel, dtype=dtype)):
        return None
    return segment, {key: _placement(ids) for key, ids in out.items()}


def row_key(key: str, segment: int, row: int) -> str:
    parts = key.split(".")
    parts[segment] = str(row)
    return ".".join(parts)


def slabs(layout: tuple[int, dict[str, Placement]], weights, row: torch.Size) -> dict[str, tuple[int, int]] | None:
    """{key of row 0: the slab [first, stop) of the row's dim 0 its file tensor fills}, when every file tensor of a
    row is such a slab in order (its shape the row's past dim 0: Mixtral's w1 and w3 the two halves of a
    `gate_up_proj` row, w2 a whole `down_proj` row); None otherwise."""
    segment, placements = layout
    inner, out = row[1:].numel(), {}
    for key, where in placements.items():
        shape = weights.info(row_key(key, segment, 0))[0]
        if not isinstance(where, tuple) or tuple(shape[1:]) != tuple(row[1:]) or where[0] % inner or \
                len(shape) < 1 or shape[0] * inner != where[1]:
            return None
        out[key] = (where[0] // inner, where[0] // inner + shape[0])
    return out


@torch.no_grad()
def read_rows(tensor, layout: tuple[int, dict[str, Placement]], weights, rows: tuple[int, int] | None = None) -> None:
    """Fill this rank's box of `tensor` (a DTensor's local shard, or the whole tensor; `rows`: a plain tensor holding
    rows [start, stop)) from `weights` (`weights.SafetensorsIndex`), one row's file tensors at a time. A box of part
    of each row (`Shard(1)`, ...) reads only its part of each file tensor where those are slabs of the row
    (`slabs`), else the row's file tensors whole."""
    segment, placements = layout
    local = local_of(tensor)
    box = local_box(tensor) or (slice(*(rows or (0, tensor.shape[0]))), *(slice(0, n) for n in tensor.shape[1:]))
    whole = all(b.stop - b.start == n for b, n in zip(box[1:], tensor.shape[1:]))
    parts = None if whole or tensor.ndim < 2 else slabs(layout, weights, tensor.shape[1:])
    for row in range(box[0].start, box[0].stop):
        target = local[row - box[0].start]
        if parts is not None:  # each file tensor's rows inside the box's dim 1, its box past that
            for key, (first, stop) in parts.items():
                lo, hi = max(first, box[1].start), min(stop, box[1].stop)
                if hi > lo:
                    value = weights.read(row_key(key, segment, row), (slice(lo - first, hi - first), *box[2:]))
                    target.narrow(0, lo - box[1].start, hi - lo).copy_(value)
            continue
        flat = (target if whole else torch.empty(tensor.shape[1:], dtype=local.dtype, device=local.device)).view(-1)
        for key, where in placements.items():
            value = weights.read(row_key(key, segment, row)).reshape(-1).to(flat.dtype)
            if isinstance(where, tuple):
                flat[where[0]:where[0] + where[1]].copy_(value)
            else:
                flat[where.long()] = value
        if not whole:  # the row's box on this rank (its columns)
            target.copy_(flat.view(tensor.shape[1:])[box[1:]])


@torch.no_grad()
def read_fused_rows(module: nn.Module, folder: str, names: list[str], module_name: str,
                    replicated: bool = False) -> tuple[list[str], list[str]]:
    """The tensors `names` transformers fuses on load (MoE experts), each rank its own rows, read row by row from
    the files of those rows alone (`expert_rows`); `replicated`: a module every rank holds whole, each rank reading
    its stripe (`shards.replicas.read_once`). Returns the names whose conversion is not row by row, and the names
    some of whose rows the files lack (left to be initialised, as `from_pretrained` does)."""
    plan, tensors = plan_folder(module), module_tensors(module)
    layouts = [(name, row_layout(module, plan, name)) for name in names]
    layouts = [(name, layout) for name, layout in layouts if layout is not None]
    absent = []
    if layouts:
        index = SafetensorsIndex.for_weights(weights_folder(folder))
        absent = [name for name, (segment, placements) in layouts if not all(
            row_key(key, segment, row) in index for key in placements for row in range(tensors[name].shape[0]))]
        layouts = [(name, layout) for name, layout in layouts if name not in absent]
        read_once([tensors[name] for name, _ in layouts], lambda i: read_rows(
            tensors[layouts[i][0]], layouts[i][1], index), f"module {module_name!r}: reading {folder}", replicated)
    done = {name for name, _ in layouts} | set(absent)
    return [name for name in names if name not in done], absent
