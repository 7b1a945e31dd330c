"""Where a module of a saved composed model is read from: its subfolder when that holds a module folder, else its
recorded source (`ModuleEntry.source`), never a path that leads outside the saved folder."""

from __future__ import annotations

import os

from ..core.config import OmniConfig, UnsafePathError
from .format import config_files


def module_folder(root: str, config: OmniConfig, name: str) -> str:
    """Where module `name` of the composed model saved at `root` is read from: its subfolder when that holds an HF
    module (a `config.json`, or another format's config file), else its recorded source, which must be an HF module
    folder. The subfolder must stay inside `root` (a symlink leaving it is refused). A clear error naming the module
    otherwise. (A module folder: one holding a module format's config file, `files.format`.)"""

    entry = config.module_entry(name)
    folder = os.path.join(root, entry.subfolder)
    inside = os.path.realpath(root)
    if os.path.lexists(folder) and os.path.dirname(os.path.realpath(folder)) != inside:
        raise UnsafePathError(f"module {name!r}: {folder} leads outside {root}")
    if any(os.path.isfile(os.path.join(folder, n)) for n in (*config_files(), "adapter_config.json")):
        return folder  # a module folder, or a LoRA checkpoint's adapter folder (its base written apart)
    source = entry.source
    if source and os.path.isdir(source):
        if not any(os.path.isfile(os.path.join(source, n)) for n in config_files()):
            raise ValueError(f"module {name!r}: source {source} is not a module folder (no config.json)")
        return source
    raise FileNotFoundError(f"module {name!r}: no folder {entry.subfolder!r} in {root} and no recorded source "
                            f"({source!r})")
