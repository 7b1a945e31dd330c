"""Offline outputs of different lengths per item: a Qwen2.5-VL tower returns a tuple of per-image tensors whose token
counts depend on each image's resolution (`@offline_encoder(..., ragged="tuple" | "concat", items=column)`).

The cache keeps one entry per source row: its items concatenated along dim 0, with each item's length (`sizes`).
A served row holds its items as a tuple; `ServedCollator` takes them out of the rows before the user's collator
runs and gives the batch the form the method returns: a tuple of every item in row order ("tuple"), or
`(values, sizes)` ("concat"). A rank whose batch has none gets one item of 0 rows (so the modules after it still
run on every rank).
"""

from __future__ import annotations

import torch


def items_of(spec, result) -> list[torch.Tensor]:
    """The method's output as a list of per-item tensors, as its declared form says."""
    if spec.ragged == "tuple":
        if not isinstance(result, (tuple, list)) or not all(isinstance(t, torch.Tensor) for t in result):
            raise ValueError(f"offline encoder {spec.method} (module {spec.module!r}) is ragged='tuple': it must "
                             f"return a tuple of per-item tensors, got {type(result).__name__}")
        return list(result)
    if not (isinstance(result, (tuple, list)) and len(result) == 2 and isinstance(result[0], torch.Tensor)):
        raise ValueError(f"offline encoder {spec.method} (module {spec.module!r}) is ragged='concat': it must return "
                         f"(values, sizes), got {type(result).__name__}")
    values, sizes = result
    sizes = sizes.tolist() if isinstance(sizes, torch.Tensor) else list(sizes)
    if sum(sizes) != len(values):
        raise ValueError(f"offline encoder {spec.method} (module {spec.module!r}): sizes {sizes} do not add up to "
                         f"the {len(values)} rows of its values")
    return list(torch.split(values, sizes))


def row_counts(spec, rows: list[dict]) -> list[int]:
    """How many items each row holds: the first dimension of its `items` column (one per row without one, or with
    a 1-D one: a single image's grid)."""
    counts = [torch.as_tensor(row[spec.items]) if spec.items else None for row in rows]
    return [len(t) if t is not None and t.dim() > 1 else 1 for t in counts]


def split_rows(spec, result, counts: list[int]) -> list[tuple[torch.Tensor, list[int]]]:
    """Each row's items, concatenated along dim 0, with each item's length along dim 0."""
    items = items_of(spec, result)
    if len(items) != sum(counts):
        raise ValueError(f"offline encoder {spec.method} (module {spec.module!r}) returned {len(items)} items for "
                         f"rows holding {sum(counts)}" + (f" (counted by {spec.items!r})" if spec.items else ""))
    out, start = [], 0
    for count in counts:
        mine = items[start:start + count]
        out.append((torch.cat(mine) if mine else items[0][:0], [len(t) for t in mine]))
        start += count
    return out


def batch_form(spec, rows: list[tuple[torch.Tensor, ...]]):
    """A batch's items (each row's tuple, in row order) in the form the method returns."""
    items = tuple(t for row in rows for t in row)
    if spec.ragged == "tuple":
        return items
    return torch.cat(items), torch.tensor([len(t) for t in items], dtype=torch.long)


def empty_form(spec, tail: tuple, dtype: torch.dtype, device):
    """What a rank without input gets: one item of 0 rows shaped like the others' (`tail`: its shape after dim 0)."""
    return batch_form(spec, [(torch.empty((0, *tail), dtype=dtype, device=device),)])


def stand_in(spec, value):
    """A tensor whose shape after dim 0 and dtype are the form's (the missing-modality exchange shares these), or
    None for no value."""
    if isinstance(value, (tuple, list)):
        return (value[0] if isinstance(value[0], torch.Tensor) else value) if len(value) else None
    return value


class ServedCollator:
    """The user's collator over served rows whose ragged outputs (tuples of items) are taken out first and added to
    the batch in their method's form."""

    def __init__(self, collator, specs: list):
        self.collator, self.specs = collator, [s for s in specs if s.ragged]

    def __call__(self, rows: list[dict]):
        held = {s.output: [row.pop(s.output) for row in rows if s.output in row] for s in self.specs}
        batch = self.collator(rows)
        for spec in self.specs:
            if held[spec.output]:
                batch[spec.output] = batch_form(spec, held[spec.output])
        return batch
