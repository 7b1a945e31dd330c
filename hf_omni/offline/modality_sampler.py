"""`group_by_modality: true`: every global batch carries the same modalities on every rank, so no rank lacks an input
that another rank has (the practice of LLaVA's trainers). A forward that skips a module when its batch has no input
for it — a released model's own `forward` does — then never pairs collectives wrongly.

A row's modalities are the `@offline_encoder` entry points whose inputs (or, for an offline module, whose cached
output) the row has. Rows are grouped by that set; each epoch every group is shuffled (seed + epoch), padded to a
whole number of global batches by repeating its own rows, cut into global batches (per-device batch x world size:
Accelerate hands rank r the r-th per-device batch of each), and the batches of all groups are shuffled together.
`train_sampling_strategy: sequential` keeps the rows and the batches in dataset order.

Where a row's modalities come from, read once (rank 0, then broadcast): a `modalities` attribute of the dataset
(one hashable per row), else a `datasets.Dataset`'s null masks of the columns (no row decoded), else every row read
once (`dataset[i]`; logged, as it may decode images).
"""

from __future__ import annotations

import logging

import torch

from ..core.dist import agreed, broadcast_from_main, is_main

logger = logging.getLogger("hf_omni")


def row_modalities(dataset, columns: dict[str, list[str]]) -> list[tuple[str, ...]]:
    """Per row, the sorted names of the modalities it has; `columns`: modality -> the columns that carry it."""
    given = getattr(dataset, "modalities", None)
    if given is not None:
        if len(given) != len(dataset):
            raise ValueError(f"group_by_modality: the dataset's `modalities` has {len(given)} entries for "
                             f"{len(dataset)} rows")
        return [tuple(sorted(m)) if isinstance(m, (list, tuple, set, frozenset)) else (m,) for m in given]
    from datasets import Dataset

    if isinstance(dataset, Dataset):
        present = {}
        for name, cols in columns.items():
            masks = [dataset.data.column(c).is_valid().to_pylist() for c in cols if c in dataset.column_names]
            present[name] = [any(m[i] for m in masks) for i in range(len(dataset))] if masks else [False] * len(dataset)
        return [tuple(n for n in sorted(columns) if present[n][i]) for i in range(len(dataset))]
    logger.info("hf_omni: group_by_modality reads each of the %d training rows once to find its modalities (give "
                "the dataset a `modalities` attribute to skip this)", len(dataset))
    out = []
    for i in range(len(dataset)):
        row = dataset[i]
        if not isinstance(row, dict):
            raise ValueError(f"group_by_modality: row {i} of the training dataset is a {type(row).__name__}, not a "
                             "dict of columns; give the dataset a `modalities` attribute (one per row)")
        out.append(tuple(n for n in sorted(columns) if any(row.get(c) is not None for c in columns[n])))
    return out


class ModalityGroupedSampler(torch.utils.data.Sampler):
    """Indices in global batches of `global_batch` rows, each of one modality set (see the module docstring)."""

    def __init__(self, keys: list[tuple[str, ...]], global_batch: int, seed: int = 0, shuffle: bool = True):
        if global_batch < 1:
            raise ValueError(f"group_by_modality: global batch {global_batch} < 1")
        self.keys, self.global_batch, self.seed, self.shuffle, self.epoch = list(keys), global_batch, seed, shuffle, 0
        self.groups: dict[tuple, list[int]] = {}
        for i, key in enumerate(self.keys):
            self.groups.setdefault(key, []).append(i)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return sum(-(-len(rows) // self.global_batch) * self.global_batch for rows in self.groups.values())

    def batches(self) -> list[list[int]]:
        """This epoch's global batches, each of one group."""
        generator = torch.Generator().manual_seed(self.seed + self.epoch)
        out = []
        for rows in self.groups.values():
            if self.shuffle:
                rows = [rows[i] for i in torch.randperm(len(rows), generator=generator).tolist()]
            short = -len(rows) % self.global_batch
            padded = rows + [rows[i % len(rows)] for i in range(short)]  # repeats of its own rows
            out += [padded[i:i + self.global_batch] for i in range(0, len(padded), self.global_batch)]
        if self.shuffle:
            out = [out[i] for i in torch.randperm(len(out), generator=generator).tolist()]
        else:
            out.sort(key=lambda batch: batch[0])
        return out

    def __iter__(self):
        for batch in self.batches():
            yield from batch


def modality_sampler(model, dataset, per_device_batch: int, world: int, seed: int, shuffle: bool,
                     group=None) -> ModalityGroupedSampler:
    """The sampler for `dataset` and `model`'s entry points; the rows' modalities read by rank 0 and broadcast."""

    columns = model.modality_columns()
    if not columns:
        raise ValueError("group_by_modality: the model has no @offline_encoder entry point, so no modality to group by")
    keys = None
    with agreed("group_by_modality: reading the rows' modalities", group):  # rank 0's error raised on every rank
        keys = row_modalities(dataset, columns) if is_main() else None
    keys = broadcast_from_main(keys, group)
    return ModalityGroupedSampler(keys, per_device_batch * world, seed=seed, shuffle=shuffle)
