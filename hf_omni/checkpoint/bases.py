"""LoRA bases written once per run (`files.lora_base`): the write, the marker's record of them, their checks at
resume and in the CLI, and which of them rotation may delete.

    first save of a run (or after resuming from a checkpoint whose base is outside this run's `frozen/`):
        token (rank 0, broadcast) -> every rank its rows of the base's files -> sizes [-> sha256 per rank]
        -> hf_omni_base.json (rank 0, atomic)
    every save: the module folder holds its adapter; the marker records {module: {name, folder, files[, sha256]}}

A checkpoint lists its bases' files with their sizes (and digests with `verify_checkpoint`): a resume checks them
as it checks its own files. Rotation deletes a base only once no complete checkpoint of the run refers to it and
the run does not use it.
"""

from __future__ import annotations

import os
import secrets
from dataclasses import dataclass

from ..core.dist import agreed, broadcast_from_main, is_main
from ..files import folder_write
from ..files.lora_base import BASE_MARKER, FROZEN, find_base, read_base_marker
from .digests import check_share, hash_checkpoint
from .marker import MARKER, check_files, complete_checkpoints, file_sizes, read_marker, write_marker

SHARED = "restore this file from a copy (every checkpoint of the run that refers to this base shares it)"


@dataclass
class Base:
    name: str  # <module>-<token>: unique per write
    folder: str  # absolute
    files: dict[str, int]
    sha256: dict | None = None  # with verify_checkpoint (on rank 0 after a write)

    def record(self) -> dict:
        return {"name": self.name, "folder": self.folder, "files": self.files,
                **({"sha256": self.sha256} if self.sha256 else {})}


def write_base(slot, plan, output_dir: str, group, verify: bool) -> Base:
    """Every rank: `slot`'s base weights (`plan`, without the adapter) into a fresh `<output_dir>/frozen/<module>-
    <token>/`, its marker last."""
    token = broadcast_from_main(secrets.token_hex(4) if is_main() else None, group)
    name = f"{slot.name}-{token}"
    folder = os.path.abspath(os.path.join(output_dir, FROZEN, name))
    with agreed(f"module {slot.name!r}: preparing {folder}", group):
        if is_main():
            os.makedirs(folder)
    with agreed(f"module {slot.name!r}: writing its LoRA base {folder}", group):  # every rank its own rows
        folder_write.write_module_folder(slot.module, folder, plan, dtypes=slot.export_dtypes)
    sizes = broadcast_from_main(file_sizes(folder, BASE_MARKER) if is_main() else None, group)
    digests = None
    if verify:
        with agreed(f"hashing {folder}", group):
            digests = hash_checkpoint(folder, sizes, group)
    base = Base(name, folder, sizes, digests)
    with agreed(f"writing {os.path.join(folder, BASE_MARKER)}", group):
        if is_main():
            write_marker(folder, {"format": 1, "module": slot.name, **base.record()}, BASE_MARKER)
    return base


def recorded(directory: str, marker: dict) -> dict[str, Base]:
    """The bases a checkpoint's marker records, found where they are now (a clear error for a malformed record
    or a base that is nowhere)."""
    bases = marker.get("bases", {})
    if not isinstance(bases, dict):
        raise ValueError(f"checkpoint {directory}: {MARKER} has a malformed 'bases' record")
    out = {}
    for module, record in bases.items():
        if not isinstance(record, dict) or not isinstance(record.get("name"), str) or \
                not isinstance(record.get("files"), dict):
            raise ValueError(f"checkpoint {directory}: {MARKER} has a malformed record of module {module!r}'s "
                             "LoRA base")
        folder = find_base(directory, record["name"], record.get("folder"))
        out[module] = Base(record["name"], folder, record["files"], record.get("sha256"))
    return out


def check_bases(directory: str, marker: dict, verify: bool | None, share: tuple[int, int]) -> None:
    """Each base a checkpoint refers to: found, every file there with its size, nothing added (`verify`: this
    rank's share of its sha256 pieces)."""
    for module, base in recorded(directory, marker).items():
        what = f"checkpoint {directory}: module {module!r}'s LoRA base {base.folder}"
        check_files(base.folder, base.files, what, BASE_MARKER, share, advice=SHARED)
        if verify or (verify is None and base.sha256):
            if not base.sha256:
                raise ValueError(f"{what} has no sha256 of its files to verify (saved without verify_checkpoint)")
            check_share(base.folder, base.files, base.sha256, *share, what=what)


def remove_unreferenced(run_dir: str, in_use: tuple[str, ...] = ()) -> list[str]:
    """Rank 0, after rotation: delete the bases under `<run_dir>/frozen/` (those with a marker) that no complete
    checkpoint of the run refers to and the run does not use (`in_use`). Returns them."""
    import shutil

    frozen = os.path.join(run_dir, FROZEN)
    if not os.path.isdir(frozen):
        return []
    keep = {os.path.realpath(f) for f in in_use}
    for checkpoint in complete_checkpoints(run_dir):
        try:
            referred = recorded(checkpoint, read_marker(checkpoint)).values()
            keep.update(os.path.realpath(b.folder) for b in referred)
        except (OSError, ValueError):  # a checkpoint that lost its base keeps nothing
            continue
    deleted = []
    for name in sorted(os.listdir(frozen)):
        folder = os.path.join(frozen, name)
        if os.path.isfile(os.path.join(folder, BASE_MARKER)) and os.path.realpath(folder) not in keep:
            os.remove(os.path.join(folder, BASE_MARKER))  # first: a deletion cut short leaves no base that looks whole
            shutil.rmtree(folder, ignore_errors=True)
            deleted.append(folder)
    return deleted


def adopt(base: Base, output_dir: str | None, verify: bool) -> bool:
    """Whether a base read at resume serves this run's next checkpoints too: it lies in this run's `frozen/` (a
    base of another run could be deleted by that run's rotation) and has digests when this run verifies."""
    if not output_dir or (verify and not base.sha256):
        return False
    frozen = os.path.realpath(os.path.join(output_dir, FROZEN))
    return os.path.dirname(os.path.realpath(base.folder)) == frozen and \
        read_base_marker(base.folder).get("name") == base.name
