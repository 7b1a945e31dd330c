"""The offline cache of one module's outputs on one dataset split, a `datasets` Arrow dataset on disk:

    <offline_cache_dir>/<module>-<split>/
        manifest.json   fingerprint (each part apart, so a stale cache names what changed), rows, columns
        part-<rank>/    `save_to_disk` of the rows that rank encoded: row (source index), value (the output row's
                        bytes, dtype kept exactly — bf16 included; null for a row without input), shape, dtype,
                        sizes (a ragged encoder's: each of the row's items' lengths; `ragged.py`)

Written to `<module>-<split>.partial/` and renamed when every rank's part is complete: a killed encode never looks
valid. Read memory-mapped (`load_from_disk`), each row found by its source index.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import os
import shutil

import numpy as np
import torch

from ..checkpoint.marker import read_json
from ..checkpoint.shard_writer import raw_bytes
from ..compat import dataset_fingerprint
from ..core.dist import agreed, is_main, rank, world_size
from ..core.progress import each
from ..files.format import format_of
from .ragged import row_counts, split_rows

MANIFEST = "manifest.json"


# -- fingerprint ------------------------------------------------------------------------------------------
def tensors_hash(tensors: dict[str, torch.Tensor]) -> str:
    digest = hashlib.sha256()
    for name in sorted(tensors):
        tensor = tensors[name]
        digest.update(f"{name}|{tensor.dtype}|{tuple(tensor.shape)}|".encode())
        digest.update(raw_bytes(tensor))
    return digest.hexdigest()


def files_hash(folder: str) -> str:
    """The content of a module folder's weight files (what an `empty_init` module will be read from)."""
    digest = hashlib.sha256()
    for name in sorted(n for n in os.listdir(folder) if n.endswith(".safetensors")):
        with open(os.path.join(folder, name), "rb") as f:
            digest.update(name.encode() + hashlib.file_digest(f, "sha256").digest())
    return digest.hexdigest()


def dataset_hash(dataset, columns: tuple[str, ...]) -> str:
    """A `datasets.Dataset`: its own fingerprint (it changes with every transform); any other map-style dataset:
    the content of `columns` in every row (one pass over them)."""

    fingerprint = dataset_fingerprint(dataset)
    if fingerprint is not None:
        return f"datasets:{fingerprint}:{len(dataset)}"
    digest = hashlib.sha256(str(len(dataset)).encode())
    for index in range(len(dataset)):
        row = dataset[index]
        for column in columns:
            value = row.get(column)
            value = torch.as_tensor(value) if value is not None else None
            digest.update(f"{column}|{None if value is None else (value.dtype, tuple(value.shape))}|".encode())
            if value is not None:
                digest.update(raw_bytes(value))
    return digest.hexdigest()


def code_hash(obj) -> str:
    """A function's source (its bytecode where no source file exists); an object's class and repr."""
    target = getattr(obj, "encoder_function", obj)
    if callable(target) and hasattr(target, "__code__"):
        try:
            text = inspect.getsource(target)
        except OSError:  # defined where no source file exists (an interactive session)
            text = target.__code__.co_code.hex()
    else:
        text = f"{type(obj).__module__}.{type(obj).__qualname__}:{obj!r}"
    return hashlib.sha256(text.encode()).hexdigest()


def fingerprint(model, spec, dataset, folder: str | None, collator=None) -> dict[str, str]:
    """What the cached outputs depend on. `folder`: where an `empty_init` module's weights are (else its tensors
    in memory are hashed); `collator`: what batches the inputs."""
    import importlib

    import transformers

    module = getattr(model, spec.module)
    config = format_of(module).describe(module)  # a transformers module: its config, less where it was saved
    dtypes = sorted({str(t.dtype) for t in list(module.parameters()) + list(module.buffers())})
    return {"weights": files_hash(folder) if folder else tensors_hash(dict(module.state_dict())),
            "config": hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode()).hexdigest(),
            "dtype": ",".join(dtypes),
            "encoder": code_hash(model.offline_encoder_code(spec)),
            "collator": code_hash(collator),
            "dataset": dataset_hash(dataset, spec.inputs),
            "hf_omni": importlib.import_module(__package__.split(".")[0]).__version__,
            "transformers": transformers.__version__}


# -- reading ----------------------------------------------------------------------------------------------
class Cache:
    """A complete cache, memory-mapped; `row(i)`: the output for source row i (None: the row had no input; a
    ragged encoder's: the tuple of the row's items)."""

    def __init__(self, folder: str, rows: int, ragged: bool = False):
        from datasets import concatenate_datasets, load_from_disk

        self.ragged = ragged
        parts = sorted(p for p in os.listdir(folder) if p.startswith("part-"))
        self.data = concatenate_datasets([load_from_disk(os.path.join(folder, p)) for p in parts])
        index = np.asarray(self.data["row"], dtype=np.int64)
        if len(index) != rows or not np.array_equal(np.sort(index), np.arange(rows)):
            raise ValueError(f"offline cache {folder}: its rows are not each source row once (corrupt)")
        self.position = np.empty(rows, dtype=np.int64)
        self.position[index] = np.arange(rows)

    def row(self, index: int) -> torch.Tensor | None:
        return self.rows([index])[0]

    def rows(self, indices: list[int]) -> list[torch.Tensor | None]:
        """Many rows in one Arrow read (a batch's worth)."""
        items = self.data[self.position[np.asarray(indices, dtype=np.int64)].tolist()]
        values = [None if value is None else
                  torch.frombuffer(bytearray(value), dtype=getattr(torch, dtype)).reshape(shape) if value else
                  torch.empty(shape, dtype=getattr(torch, dtype))  # an empty output row: frombuffer refuses 0 bytes
                  for value, dtype, shape in zip(items["value"], items["dtype"], items["shape"])]
        if not self.ragged:
            return values
        return [None if v is None else tuple(torch.split(v, sizes)) for v, sizes in zip(values, items["sizes"])]


def read_manifest(folder: str) -> dict | None:
    """A cache's manifest; None when absent or unreadable (then the cache is not valid and is recomputed)."""

    try:
        manifest = read_json(os.path.join(folder, MANIFEST))
    except (json.JSONDecodeError, UnicodeDecodeError):
        return None
    return manifest if isinstance(manifest, dict) else None


def changes(manifest: dict | None, want: dict, rows: int) -> list[str]:
    """What differs between a cache's manifest and what it should be ([] : valid)."""
    if manifest is None:
        return ["no complete cache"]
    have = manifest.get("fingerprint")
    if not isinstance(have, dict):
        return ["no complete cache"]
    changed = [key for key in want if have.get(key) != want[key]]
    return changed + (["rows"] if manifest.get("rows") != rows else [])


# -- writing ----------------------------------------------------------------------------------------------
HELD = 128 * 2**20  # encoder output bytes held before they are written as one part (Arrow's copy doubles it)


def _empty_part() -> dict:
    return {"row": [], "value": [], "shape": [], "dtype": [], "sizes": []}


@torch.no_grad()
def encode_rows(model, spec, dataset, collator, batch_size: int, device):
    """This rank's rows (rank::world_size) through the encoder method, in batches of the declared inputs; yields
    them in parts of about `HELD` bytes of outputs (at least one part, maybe empty), so that encoding holds a
    bounded amount whatever the dataset's size."""
    method = model.offline_encoder_call(spec)  # no cross-rank step
    out, held, parts = _empty_part(), 0, 0
    mine = list(range(rank(), len(dataset), world_size()))
    for start in each(range(0, len(mine), batch_size), f"encoding {spec.module!r} offline", unit="batch"):
        chunk = mine[start:start + batch_size]
        items = [dataset[i] for i in chunk]
        have = [j for j, item in enumerate(items) if all(item.get(c) is not None for c in spec.inputs)]
        values: dict[int, torch.Tensor] = {}
        if have:
            batch = collator([{c: items[j][c] for c in spec.inputs} for j in have])
            result = method(**{c: torch.as_tensor(batch[c]).to(device) for c in spec.inputs})
            if spec.ragged:  # each row's items concatenated, with their lengths
                split = split_rows(spec, result, row_counts(spec, [items[j] for j in have]))
                values = {j: (value.detach().cpu(), sizes) for (value, sizes), j in zip(split, have)}
            elif not isinstance(result, torch.Tensor) or result.shape[0] != len(have):
                raise ValueError(f"offline encoder {spec.method} (module {spec.module!r}) must return a tensor with "
                                 f"one row per input row ({len(have)}), got {getattr(result, 'shape', type(result))}"
                                 "; outputs of different lengths per item: declare ragged=")
            else:
                result = result.detach().cpu()
                values = {j: (result[k], []) for k, j in enumerate(have)}
        for j, index in enumerate(chunk):
            value, sizes = values.get(j, (None, []))
            out["sizes"].append(sizes)
            out["row"].append(index)
            out["value"].append(np.frombuffer(raw_bytes(value), dtype=np.uint8) if value is not None else None)
            out["shape"].append(list(value.shape) if value is not None else [])
            out["dtype"].append(str(value.dtype).removeprefix("torch.") if value is not None else "")
            held += 0 if value is None else len(out["value"][-1])
        if held >= HELD:
            yield out
            out, held, parts = _empty_part(), 0, parts + 1
    if out["row"] or not parts:
        yield out


def arrow_columns(rows: dict) -> dict:
    """`encode_rows`' output as Arrow arrays; the values one buffer with offsets (no per-row Python bytes)."""
    import pyarrow as pa

    values = rows["value"]
    lengths = np.array([0 if v is None else len(v) for v in values], dtype=np.int64)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    data = np.concatenate([v for v in values if v is not None] or [np.zeros(0, np.uint8)])
    valid = None if all(v is not None for v in values) else pa.array([v is not None for v in values]).buffers()[1]
    value = pa.LargeBinaryArray.from_buffers(pa.large_binary(), len(values),
                                             [valid, pa.py_buffer(offsets), pa.py_buffer(data)])
    return {"row": pa.array(rows["row"], pa.int64()), "value": value,
            "shape": pa.array(rows["shape"], pa.list_(pa.int64())), "dtype": pa.array(rows["dtype"], pa.string()),
            "sizes": pa.array(rows["sizes"], pa.list_(pa.int64()))}


def write_cache(model, spec, dataset, folder: str, want: dict, collator, batch_size: int, device, group) -> None:
    """Every rank encodes its rows into `<folder>.partial/part-<rank>-<n>`, one part per `HELD` bytes of outputs;
    then rank 0 writes the manifest and renames the folder into place (the previous, stale cache removed first)."""
    from datasets import Dataset, Features, Sequence, Value

    partial = folder + ".partial"
    with agreed(f"offline cache: preparing {partial}", group):
        if is_main():
            shutil.rmtree(partial, ignore_errors=True)  # left by an encode that was killed
            os.makedirs(partial)
    with agreed(f"module {spec.module!r}: encoding into {partial}", group):
        features = Features({"row": Value("int64"), "value": Value("large_binary"), "shape": Sequence(Value("int64")),
                             "dtype": Value("string"), "sizes": Sequence(Value("int64"))})
        for number, rows in enumerate(encode_rows(model, spec, dataset, collator, batch_size, device)):
            Dataset.from_dict(arrow_columns(rows), features=features).save_to_disk(
                os.path.join(partial, f"part-{rank():05d}-{number:05d}"))
    with agreed(f"offline cache: writing {folder}", group):
        if is_main():
            with open(os.path.join(partial, MANIFEST), "w") as f:
                json.dump({"module": spec.module, "inputs": list(spec.inputs), "output": spec.output,
                           "rows": len(dataset), "fingerprint": want}, f, indent=2)
            shutil.rmtree(folder, ignore_errors=True)
            os.replace(partial, folder)
