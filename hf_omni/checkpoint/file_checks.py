"""Whether a checkpoint's file can be read, from its first bytes alone: a safetensors file's header (its length, its
JSON, each tensor's bytes lying inside the file, DCP's sharding record of a `state/` shard) and a JSON file parsed.

Why: a damaged file otherwise fails deep inside safetensors or DCP ("invalid JSON in header", "metadata is None")
without naming itself, or, like an adopted model's `released/` copy, which no resume reads, not until its export is
loaded somewhere else. `files.check_files` runs these on each rank's share of the listed files, so a resume or an
export refuses the checkpoint before anything is read or written. Cheap at any size: no tensor data is read, only
headers (a few MB at most) and JSON files (configs, states, tokenizers), each file by one rank.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import struct

from ..compat import dcp_sharding_info_key

MAX_HEADER = 100_000_000  # safetensors refuses longer headers
BITS = {"BOOL": 8, "U8": 8, "I8": 8, "F8_E4M3": 8, "F8_E5M2": 8, "F8_E8M0": 8, "I16": 16, "U16": 16, "F16": 16,
        "BF16": 16, "I32": 32, "U32": 32, "F32": 32, "I64": 64, "U64": 64, "F64": 64, "C64": 64, "F4": 4,
        "F6_E2M3": 6, "F6_E3M2": 6}  # safetensors' dtypes; another name is only bounds-checked
EARLIER = "resume or export from an earlier checkpoint (or restore this file from a copy)"
NEEDS = {"optimizer.json": {"state", "param_groups"}, "scheduler.json": {"last_epoch", "base_lrs"}}  # in `state/`


def problem(path: str, size: int | None = None) -> str | None:
    """What is wrong with the file at `path` (`size`: its size, when already known), said of it ("is not valid
    JSON (...)"), or None. Files other than safetensors and JSON are not looked into."""
    try:
        if path.endswith(".safetensors"):
            found = safetensors_problem(path, os.path.getsize(path) if size is None else size)
            return f"is damaged: {found}" if found else None
        if path.endswith(".json"):
            return json_problem(path)
    except OSError as err:
        return f"cannot be read ({err})"
    return None


def json_problem(path: str) -> str | None:
    with open(path, "rb") as f:
        try:
            value = json.loads(f.read())
        except ValueError as err:  # JSONDecodeError and UnicodeDecodeError alike
            return f"is not valid JSON ({err})"
    return keys_problem(path, value)


def keys_problem(path: str, value) -> str | None:
    """A JSON file a resume reads, without the keys it needs or with keys the reader refuses (a key renamed by hand
    leaves valid JSON, found otherwise only when Trainer or the optimizer reads it): said of it, or None."""
    name, parent = os.path.basename(path), os.path.basename(os.path.dirname(path))
    if name == "trainer_state.json":
        from transformers import TrainerState

        known = {f.name for f in dataclasses.fields(TrainerState)}
        need, unknown = {"global_step", "log_history"}, set(value) - known if isinstance(value, dict) else set()
        if not isinstance(value, dict) or unknown or need - set(value):
            return (f"is not a TrainerState's JSON (unknown keys {sorted(unknown)}, missing "
                    f"{sorted(need - set(value)) if isinstance(value, dict) else sorted(need)})")
    elif parent == "state" and name in NEEDS:
        groups = value.get("param_groups") if isinstance(value, dict) else None
        missing = sorted(NEEDS[name] - set(value)) if isinstance(value, dict) else sorted(NEEDS[name])
        if missing or (name == "optimizer.json" and not all(isinstance(g, dict) and "params" in g for g in groups)):
            lacking = missing or "params of a param group"
            return f"is not an hf_omni {name} (it lacks the keys a resume reads: {lacking})"
    return None


def safetensors_problem(path: str, size: int) -> str | None:
    """The header as safetensors itself validates it: length, JSON, each tensor's dtype, shape and byte range, the
    ranges covering the data exactly; then DCP's sharding record, when the header has one."""
    if size < 8:
        return f"it has {size} bytes, fewer than a safetensors header's length"
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        if length > min(size - 8, MAX_HEADER):
            return f"its header claims {length} bytes, the file has {size}"
        try:
            header = json.loads(f.read(length))
        except ValueError as err:
            return f"its safetensors header is not valid JSON ({err})"
    if not isinstance(header, dict):
        return "its safetensors header is not a JSON object"
    metadata, data, ranges = header.pop("__metadata__", None) or {}, size - 8 - length, []
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        return "its safetensors header's __metadata__ is not a map of strings"
    for name, info in header.items():
        found = _tensor_problem(info, data)
        if found:
            return f"tensor {name!r} in its header: {found}"
        ranges.append((*info["data_offsets"], name))
    end = 0
    for begin, stop, name in sorted(ranges):
        if begin != end:
            return f"tensor {name!r} in its header starts at byte {begin} of the data, the previous one ends at {end}"
        end = stop
    if end != data:
        return f"its header's tensors end at byte {end} of the data, the file holds {data}"
    return _sharding_problem(metadata, header)


def _tensor_problem(info, data: int) -> str | None:
    if not isinstance(info, dict):
        return "not a tensor record"
    shape, offsets, bits = info.get("shape"), info.get("data_offsets"), BITS.get(info.get("dtype"))
    if not isinstance(info.get("dtype"), str) or not _ints(shape) or not _ints(offsets) or len(offsets) != 2:
        return f"a malformed record {info}"
    begin, stop = offsets
    if not 0 <= begin <= stop <= data:
        return f"its bytes {begin}-{stop} lie outside the file's {data} bytes of data"
    if bits is not None and (stop - begin) * 8 != math.prod(shape) * bits:
        return f"{stop - begin} bytes for a {info['dtype']} tensor of shape {shape}"
    return None


def _sharding_problem(metadata: dict, header: dict) -> str | None:
    """A `state/` shard's record of where each tensor lies in the whole (DCP reads it to reshard)."""

    if dcp_sharding_info_key() not in metadata:
        return None
    try:
        sharding = json.loads(metadata[dcp_sharding_info_key()])
    except ValueError as err:
        return f"its DCP sharding record is not valid JSON ({err})"
    for name, info in header.items():
        entry = sharding.get(name) if isinstance(sharding, dict) else None
        offsets = entry.get("saved_offsets") if isinstance(entry, dict) else None
        if not _ints(offsets) or len(offsets) != len(info["shape"]):
            return f"its DCP sharding record has no offsets of tensor {name!r}"
    return None


def _ints(value) -> bool:
    return isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value)
