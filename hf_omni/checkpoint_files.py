"""The files of a per-module checkpoint: the completion marker, checks, rotation, and one module's optimizer and
scheduler state. `checkpoint.ModuleCheckpointer` decides what is written when.

    <dir>/config.json                 root OmniConfig (module sources recorded)
    <dir>/<module>/                   each module with trainable parameters, loadable as is with from_pretrained
        config.json, model.safetensors (+ adapter files for LoRA), tokenizer / processor files
        state/                        optimizer state through torch.distributed.checkpoint (each rank writes its
                                      own shards, no gather) + scheduler.json
    <dir>/hf_omni_checkpoint.json     written last, atomically: step, world size, modules, files

What we chose: module weights are written once, as the HF files (gathered to rank 0, one tensor at a time);
they also serve resume — each rank reads back only its own rows of a sharded module. Optimizer state never
leaves its shards: DCP reshards it on load, so a checkpoint resumes at another world size.
Fully frozen modules write nothing; they reload from their recorded source (a module built in memory is written
once to `<output_dir>/frozen/<module>/`, which becomes its source).
"""

from __future__ import annotations

import json
import os
import re

import torch

from .dist import world_size

MARKER = "hf_omni_checkpoint.json"
STATE = "state"
SCHEDULER = "scheduler.json"
FORMAT = 1
_STEP = re.compile(r"checkpoint-(\d+)$")


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_marker(directory: str, info: dict) -> None:
    """Atomically (temp file + fsync + rename + fsync of the folder) mark `directory` as complete."""
    tmp = os.path.join(directory, MARKER + ".tmp")
    with open(tmp, "w") as f:
        json.dump(info, f, indent=2, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(directory, MARKER))
    fsync_dir(directory)


def listed_files(directory: str) -> list[str]:
    """Every file under `directory` (relative paths), the marker excluded."""
    out = []
    for root, _, files in os.walk(directory):
        for name in files:
            rel = os.path.relpath(os.path.join(root, name), directory)
            if rel not in (MARKER, MARKER + ".tmp"):
                out.append(rel)
    return sorted(out)


def read_marker(directory: str) -> dict | None:
    path = os.path.join(directory, MARKER)
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return json.load(f)


def check_complete(directory: str) -> dict:
    """The marker of a complete checkpoint; a clear error for a missing path, a missing or malformed marker, a
    missing or truncated file, or a file the marker does not list."""
    if not os.path.isdir(directory):
        raise FileNotFoundError(f"checkpoint {directory} does not exist")
    try:
        marker = read_marker(directory)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"checkpoint {directory}: {MARKER} is not valid JSON ({err})") from None
    if marker is None:
        raise ValueError(f"checkpoint {directory} has no {MARKER}: it is incomplete (a crash during its save?)")
    if not isinstance(marker, dict) or not isinstance(marker.get("files"), dict):
        raise ValueError(f"checkpoint {directory}: {MARKER} has no file list")
    extra = sorted(set(listed_files(directory)) - set(marker["files"]))
    if extra:
        raise ValueError(f"checkpoint {directory}: file {extra[0]} is not listed in {MARKER} (added after the save?)")
    for rel, size in marker["files"].items():
        if os.path.isabs(rel) or ".." in rel.replace("\\", "/").split("/"):
            raise ValueError(f"checkpoint {directory}: {MARKER} lists a path outside it: {rel!r}")
        path = os.path.join(directory, rel)
        if not os.path.isfile(path):
            raise ValueError(f"checkpoint {directory}: file {rel} is missing")
        if os.path.getsize(path) != size:
            raise ValueError(f"checkpoint {directory}: file {rel} has {os.path.getsize(path)} bytes, "
                             f"{size} were written")
    return marker


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


def newest_complete_checkpoint(run_dir: str) -> str | None:
    found = complete_checkpoints(run_dir)
    return found[-1] if found else None


def rotate(run_dir: str, limit: int | None, best: str | None = None) -> list[str]:
    """Delete the oldest complete checkpoints beyond `limit`; never the newest nor `best`; incomplete ones are
    neither counted nor deleted here. Returns what was deleted."""
    import shutil

    if not limit or limit <= 0:
        return []
    found = complete_checkpoints(run_dir)
    keep = {found[-1]} if found else set()
    if best:
        keep.add(os.path.abspath(best))
    deletable = [p for p in found if p not in keep and os.path.abspath(p) not in keep]
    excess = len(found) - limit
    deleted = deletable[:max(excess, 0)]
    for path in deleted:  # the marker first: a deletion cut short leaves an incomplete checkpoint, never a broken one
        os.remove(os.path.join(path, MARKER))
        fsync_dir(path)
        shutil.rmtree(path, ignore_errors=True)
    return deleted


# -- one module's resume state --------------------------------------------------------------------------
def make_stager():
    """A DCP stager for async saves, kept per module: it copies the state before `save_state` returns (training may
    then change it) into buffers it reuses from one save to the next (no fresh allocation on every save)."""
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    gpu = torch.cuda.is_available()
    return DefaultStager(StagingOptions(use_pinned_memory=gpu, use_shared_memory=False, use_async_staging=False,
                                        use_non_blocking_copy=gpu))


def save_scheduler(scheduler, folder: str) -> None:
    """The module's scheduler state in `state/` as JSON (rank 0): read back without unpickling anything."""
    os.makedirs(os.path.join(folder, STATE), exist_ok=True)
    state = scheduler.state_dict()
    try:
        text = json.dumps(state)
    except TypeError as err:
        raise TypeError(f"scheduler {type(scheduler).__name__}: its state is not JSON ({err})") from None
    with open(os.path.join(folder, STATE, SCHEDULER), "w") as f:
        f.write(text)


def save_module_state(module, optimizer, folder: str, tensors: dict, stager=None, executor=None, group=None):
    """`state/`: the optimizer state and the module `tensors` its HF files cannot serve as is, through DCP (every
    rank its own shards; DCP itself raises on every rank when one fails). Async (`stager`): the state is copied
    now, then written by `executor` — one background thread for every module, in the same order on every rank,
    its collectives on `group` alone (a gloo group: CPU tensors under any training backend); returns the future."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    state_dir = os.path.join(folder, STATE)
    os.makedirs(state_dir, exist_ok=True)
    state = {"optimizer": get_optimizer_state_dict(module, optimizer), "tensors": tensors}
    if stager is None:
        dcp.save(state, checkpoint_id=state_dir)
        return None
    staged = stager.stage(state)
    return executor.submit(dcp.save, staged, checkpoint_id=state_dir, process_group=group)


def state_keys(folder: str) -> list[str]:
    """The sorted keys a module's `state/` holds (DCP's flattened names: `optimizer.state.<param>.<name>`,
    `tensors.<name>`)."""
    import torch.distributed.checkpoint as dcp

    return sorted(dcp.FileSystemReader(os.path.join(folder, STATE)).read_metadata().state_dict_metadata)


def load_module_tensors(folder: str, tensors: dict) -> None:
    """Only the module `tensors` of a `state/` (no optimizer): DCP reads just the keys asked for."""
    import torch.distributed.checkpoint as dcp

    if tensors:
        dcp.load({"tensors": tensors}, checkpoint_id=os.path.join(folder, STATE))


def load_module_state(module, optimizer, scheduler, folder: str, tensors: dict) -> None:
    """Read back `save_module_state`: `tensors` in place, the optimizer (resharded by DCP at another world size;
    parameters that had no state when saved — never stepped, e.g. unused by the forward — get none), scheduler."""
    import bisect

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions, get_optimizer_state_dict, set_optimizer_state_dict,
    )

    state_dir = os.path.join(folder, STATE)
    saved = state_keys(folder)
    optim_state = get_optimizer_state_dict(module, optimizer)

    def has_saved_state(fqn: str) -> bool:
        prefix = f"optimizer.state.{fqn}."
        at = bisect.bisect_left(saved, prefix)
        return at < len(saved) and saved[at].startswith(prefix)

    stateless = [fqn for fqn in optim_state["state"] if not has_saved_state(fqn)]
    for fqn in stateless:
        del optim_state["state"][fqn]
    state = {"optimizer": optim_state, "tensors": tensors}
    dcp.load(state, checkpoint_id=state_dir)
    set_optimizer_state_dict(module, optimizer, state["optimizer"], options=StateDictOptions(strict=not stateless))
    params = dict(module.named_parameters())
    for fqn in stateless:  # as in the saved run: no state until their first gradient
        optimizer.state.pop(params[fqn], None)
    with open(os.path.join(state_dir, SCHEDULER)) as f:
        scheduler.load_state_dict(json.load(f))


def marker_info(directory: str, step: int | None, modules: list[str], resumable: bool = True) -> dict:
    files = {rel: os.path.getsize(os.path.join(directory, rel)) for rel in listed_files(directory)}
    return {"format": FORMAT, "step": step, "world_size": world_size(), "modules": modules, "files": files,
            "resumable": resumable}
