"""A checkpoint's completion marker and the files it lists: written atomically, read back, every file listed with its
size and checked against the list, and the checkpoints of a run that carry one.

    <dir>/hf_omni_checkpoint.json     written last, atomically (temp file + fsync + rename + fsync of the folder)
    <output_dir>/frozen/<module>-<token>/hf_omni_base.json    a LoRA base's marker, written and checked the same way

What a marker holds and how a whole checkpoint is checked and rotated: `contents.py`.
"""

from __future__ import annotations

import json
import os
import re

from ..core.errors import DamagedFileError
from . import file_checks

MARKER = "hf_omni_checkpoint.json"
_STEP = re.compile(r"checkpoint-(\d+)$")


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_marker(directory: str, info: dict, name: str = MARKER) -> None:
    """Atomically (temp file + fsync + rename + fsync of the folder) mark `directory` as complete."""
    tmp = os.path.join(directory, name + ".tmp")
    with open(tmp, "w") as f:
        json.dump(info, f, indent=2, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(directory, name))
    fsync_dir(directory)


def listed_files(directory: str, marker: str = MARKER) -> list[str]:
    """Every file under `directory` (relative paths), the marker excluded."""
    out = []
    for root, _, files in os.walk(directory):
        for name in files:
            rel = os.path.relpath(os.path.join(root, name), directory)
            if rel not in (marker, marker + ".tmp"):
                out.append(rel)
    return sorted(out)


def read_json(path: str):
    """A JSON file's value; None when there is no such file."""
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return json.load(f)


def read_marker(directory: str) -> dict | None:
    return read_json(os.path.join(directory, MARKER))


def check_files(directory: str, listed: dict[str, int], what: str, marker: str = MARKER,
                share: tuple[int, int] = (0, 1), advice: str = file_checks.EARLIER) -> None:
    """Every file `listed` (relative path -> size) under `directory` with its size and, for safetensors and JSON,
    a header or content that parses (`file_checks`), and no other file there. `share` (rank, world): this rank
    checks file i of the sorted list when i mod world == rank, and rank 0 lists the folder for files not listed,
    so a resume checks each file once in all (the ranks then agree). A damaged file is a `DamagedFileError` naming
    it and saying what to do (`advice`)."""
    rank, world = share
    if rank == 0:
        extra = sorted(set(listed_files(directory, marker)) - set(listed))
        if extra:
            raise ValueError(f"{what}: file {extra[0]} is not listed in {MARKER} (added after the save?)")
    for i, (rel, size) in enumerate(sorted(listed.items())):
        if os.path.isabs(rel) or ".." in rel.replace("\\", "/").split("/"):
            raise ValueError(f"{what}: {MARKER} lists a path outside it: {rel!r}")
        if i % world != rank:
            continue
        path = os.path.join(directory, rel)
        if not os.path.isfile(path):
            raise DamagedFileError(path, f"{what}: file {rel} is missing; {advice}")
        if os.path.getsize(path) != size:
            raise DamagedFileError(path, f"{what}: file {rel} has {os.path.getsize(path)} bytes, {size} were "
                                   f"written; {advice}")
        found = None if os.path.islink(path) else file_checks.problem(path, size)  # a link is never read or copied
        if found:
            raise DamagedFileError(path, f"{what}: file {rel} {found}; {advice}")


def complete_checkpoints(run_dir: str) -> list[str]:
    """Checkpoints under `run_dir` that carry a marker, oldest step first."""
    if not os.path.isdir(run_dir):
        return []
    found = []
    for name in os.listdir(run_dir):
        match = _STEP.search(name)
        path = os.path.join(run_dir, name)
        if match and os.path.isdir(path) and os.path.isfile(os.path.join(path, MARKER)):
            found.append((int(match.group(1)), path))
    return [path for _, path in sorted(found)]


def file_sizes(directory: str, marker: str = MARKER) -> dict[str, int]:
    return {rel: os.path.getsize(os.path.join(directory, rel)) for rel in listed_files(directory, marker)}
