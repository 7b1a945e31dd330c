"""A checkpoint pushed as a folder of the composition repo (`hub_strategy: checkpoint | all_checkpoints`):

    <repo>/last-checkpoint/ (or checkpoint-N/)   the checkpoint's files, no local path in them
    <repo>/frozen/<module>-<token>/              the LoRA bases it refers to (`checkpoint.bases`), beside it as in
                                                 the run's output_dir, so that a download resumes as it is

Local paths stay local: the root config's module sources are dropped, the marker's and bases' recorded folders
too, and a module's adapter config names its base by its path inside the repo.
"""

from __future__ import annotations

import hashlib
import json
import os
import posixpath

from ..checkpoint.bases import recorded
from ..checkpoint.digests import PIECE
from ..checkpoint.marker import MARKER, read_marker
from ..files.folder import adapter_config_with_base
from ..files.lora_base import BASE_MARKER, FROZEN, base_reference
from ..lora.adapters import ADAPTER_CONFIG


def scrubbed_config(path: str) -> bytes:
    """A root config without the local `source` paths of its modules."""
    with open(path) as f:
        config = json.load(f)
    config["modules"] = [{**m, "source": None} for m in config.get("modules", [])]
    return json.dumps(config, indent=2, sort_keys=True).encode()


def scrubbed_record(path: str, rewritten: dict[str, bytes] | None = None) -> bytes:
    """A checkpoint marker or base marker without the local folders of the bases it records; the files this push
    rewrote (`rewritten`) listed with their new sizes and sha256, so that the pushed checkpoint checks complete."""

    with open(path) as f:
        info = json.load(f)
    if "folder" in info:
        info["folder"] = None
    if "bases" in info:
        info["bases"] = {m: {**b, "folder": None} for m, b in info["bases"].items()}
    for rel, content in (rewritten or {}).items():
        if rel in info.get("files", {}):
            info["files"][rel] = len(content)
        if rel in info.get("sha256", {}):
            info["sha256"][rel] = [hashlib.sha256(content[i:i + PIECE]).hexdigest()
                                   for i in range(0, len(content), PIECE)] or [hashlib.sha256(b"").hexdigest()]
    return json.dumps(info, indent=2, sort_keys=True).encode()


def checkpoint_bases(folder: str) -> dict[str, str]:
    """Base name -> its local folder, for each LoRA base a checkpoint's marker records (none for an export)."""

    marker = read_marker(folder) if os.path.isdir(folder) else None
    return {b.name: b.folder for b in recorded(folder, marker).values()} if isinstance(marker, dict) else {}


def folder_operations(folders: dict[str, str]) -> tuple[list, tuple[str, ...]]:
    """Each local folder added under its path in the repo, with the bases it refers to under `frozen/`; and the
    path prefixes this push manages (what a previous push left there is deleted by `commit`: `last-checkpoint/`
    must not keep another world size's shards)."""
    from huggingface_hub import CommitOperationAdd

    ops, prefixes, bases = [], [], {}
    for path_in_repo, folder in folders.items():
        prefixes.append(f"{path_in_repo}/")
        found = checkpoint_bases(folder)
        bases.update(found)
        local, rewritten = {}, {}
        for root, _, names in os.walk(folder):
            for n in sorted(names):
                rel = os.path.relpath(os.path.join(root, n), folder).replace(os.sep, "/")
                local[rel] = os.path.join(root, n)
                reference = base_reference(root) if n == ADAPTER_CONFIG else None
                if rel == "config.json":
                    rewritten[rel] = scrubbed_config(local[rel])
                elif reference and os.path.basename(os.path.normpath(reference)) in found:
                    in_repo = posixpath.dirname(f"{path_in_repo}/{rel}")
                    name = os.path.basename(os.path.normpath(reference))
                    rewritten[rel] = adapter_config_with_base(root, posixpath.relpath(f"{FROZEN}/{name}", in_repo))
        if MARKER in local:
            rewritten[MARKER] = scrubbed_record(local[MARKER], rewritten)
        ops += [CommitOperationAdd(f"{path_in_repo}/{rel}", rewritten.get(rel, path)) for rel, path in local.items()]
    for name, base in sorted(bases.items()):
        prefixes.append(f"{FROZEN}/{name}/")
        for n in sorted(os.listdir(base)):
            local = os.path.join(base, n)
            if os.path.isfile(local) and not n.endswith(".tmp"):
                ops.append(CommitOperationAdd(f"{FROZEN}/{name}/{n}", scrubbed_record(local) if n == BASE_MARKER
                                              else local))
    return ops, tuple(prefixes)
