"""The files of a per-module checkpoint: what the completion marker records, the check of a whole checkpoint (its
LoRA bases included), rotation and the GradScaler's file (writing and reading the marker, listing and checking
files: `marker.py`; one module's optimizer and scheduler state: `module_state.py`). `checkpointer.ModuleCheckpointer`
decides what is written when.

    <dir>/config.json                 root OmniConfig (module sources recorded)
    <dir>/<module>/                   each module with trainable parameters, loadable as is with from_pretrained
        config.json, model.safetensors (+ adapter files for LoRA), tokenizer / processor files
        state/                        optimizer state (`module_state.py`: safetensors shards through DCP, each
                                      rank its own, no gather; JSON for the rest) + scheduler.json
    <dir>/scaler.json                 fp16's shared GradScaler state, when there is one
    <dir>/hf_omni_checkpoint.json     written last, atomically: step, world size, modules, files, LoRA bases
    <output_dir>/frozen/<module>-<token>/   a LoRA module's frozen base, written once per run (`bases.py`): the
                                      module folder then holds config + adapter, its adapter config names the base

What we chose: module weights are written once, as the HF files (every rank its own rows, in place); they also
serve resume — each rank reads back only its own rows of a sharded module. Optimizer state never leaves its
shards: DCP reshards it on load, so a checkpoint resumes at another world size.
Fully frozen modules write nothing; they reload from their recorded source (a module built in memory is written
once to `<output_dir>/frozen/<module>/`, which becomes its source).
"""

from __future__ import annotations

import json
import os

from ..core.dist import world_size
from ..core.errors import DamagedFileError
from . import file_checks
from .bases import check_bases, remove_unreferenced
from .digests import check_share
from .marker import MARKER, check_files, complete_checkpoints, file_sizes, fsync_dir, read_marker

SCALER = "scaler.json"
FORMAT = 2  # 1: module state through DCP's pickled `.metadata` (never loaded: see module_state.py)


def check_complete(directory: str, verify: bool | None = False, share: tuple[int, int] = (0, 1)) -> dict:
    """The marker of a complete checkpoint; a clear error for a missing path, a missing or malformed marker, a
    missing or truncated file, or a file the marker does not list. `verify`: the sha256 of the pieces of the files
    dealt to rank `share[0]` of `share[1]` (`digests`; all of them by default) too (a change that keeps the size);
    None: when the marker has them."""
    if not os.path.isdir(directory):
        raise FileNotFoundError(f"checkpoint {directory} does not exist")
    try:
        marker = read_marker(directory)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise DamagedFileError(os.path.join(directory, MARKER), f"checkpoint {directory}: {MARKER} is not valid JSON "
                               f"({err}); {file_checks.EARLIER}") from None
    if marker is None:
        raise ValueError(f"checkpoint {directory} has no {MARKER}: it is incomplete (a crash during its save?)")
    if not isinstance(marker, dict) or not isinstance(marker.get("files"), dict):
        raise DamagedFileError(os.path.join(directory, MARKER), f"checkpoint {directory}: {MARKER} has no file list; "
                               f"{file_checks.EARLIER}")
    if marker.get("format") != FORMAT:
        raise ValueError(f"checkpoint {directory} has format {marker.get('format')!r}, this hf_omni reads format "
                         f"{FORMAT} (format 1 kept optimizer state in a pickle, which is never loaded)")
    check_files(directory, marker["files"], f"checkpoint {directory}", share=share)
    if verify or (verify is None and "sha256" in marker):
        check_share(directory, marker["files"], marker.get("sha256") or {}, *share)
    check_bases(directory, marker, verify, share)
    return marker


def newest_complete_checkpoint(run_dir: str) -> str | None:
    found = complete_checkpoints(run_dir)
    return found[-1] if found else None


def rotate(run_dir: str, limit: int | None, best: str | None = None, busy: tuple[str, ...] = (),
           bases: tuple[str, ...] = ()) -> list[str]:
    """Delete the oldest complete checkpoints beyond `limit`; never the newest nor `best` nor one `busy` (being
    pushed to the Hub); incomplete ones are neither counted nor deleted here. Then the LoRA bases under
    `frozen/` no complete checkpoint refers to, except those the run uses (`bases`). Returns what was deleted."""
    import shutil

    if not limit or limit <= 0:
        return []
    found = complete_checkpoints(run_dir)
    keep = {found[-1]} if found else set()
    keep.update(os.path.abspath(p) for p in ((best,) if best else ()) + tuple(busy))
    deletable = [p for p in found if p not in keep and os.path.abspath(p) not in keep]
    excess = len(found) - limit
    deleted = deletable[:max(excess, 0)]
    for path in deleted:  # the marker first: a deletion cut short leaves an incomplete checkpoint, never a broken one
        os.remove(os.path.join(path, MARKER))
        fsync_dir(path)
        shutil.rmtree(path, ignore_errors=True)
    return deleted + remove_unreferenced(run_dir, bases)


def save_scaler(scaler, directory: str) -> None:
    """fp16's GradScaler (one for the whole model) as JSON (rank 0): its scale survives a resume."""
    if scaler is not None:
        with open(os.path.join(directory, SCALER), "w") as f:
            json.dump(scaler.state_dict(), f)


def load_scaler(scaler, directory: str) -> None:
    """Read back `save_scaler`; a checkpoint of a run without one leaves the scaler at its initial scale."""
    path = os.path.join(directory, SCALER)
    if scaler is not None and os.path.isfile(path):
        with open(path) as f:
            scaler.load_state_dict(json.load(f))


def marker_info(directory: str, step: int | None, modules: list[str], resumable: bool = True,
                sizes: dict[str, int] | None = None, digests: dict | None = None, bases: dict | None = None) -> dict:
    """The marker: its files and their sizes (`sizes`, listed now by default), with `verify_checkpoint` the
    sha256 of their pieces (`digests.hash_checkpoint`), and the LoRA bases its modules refer to (`bases`)."""
    info = {"format": FORMAT, "step": step, "world_size": world_size(), "modules": modules,
            "files": sizes if sizes is not None else file_sizes(directory), "resumable": resumable}
    if digests is not None:
        info["sha256"] = digests
    if bases:
        info["bases"] = bases
    return info
