"""The Hub's names: whether a path names a repo, and the layouts a push can take (repo ids are checked by
`config.repo_id_error`, which the root config's entries need too)."""

from __future__ import annotations

import os
import re

from ..core.config import repo_id_error

HUB_LAYOUTS = ("per_module", "single")  # a repo per module plus the composition repo | one repo


def is_hub_id(path: str) -> bool:
    """Not a local folder, and shaped like a repo id."""
    return not os.path.exists(path) and not path.startswith((".", "/", "~")) and repo_id_error(path) is None


def cache_snapshot(path: str) -> tuple[str, str] | None:
    """(repo id, commit) when `path` is a Hub cache snapshot (`<cache>/models--org--name/snapshots/<commit>`): what a
    module loaded out of a composition repo (`download.download_composition`) has as `_name_or_path`. Its folder
    name is the commit it holds; a repo id never holds `--`, so the repo folder's name reads back unambiguously."""
    snapshot = os.path.normpath(os.path.abspath(path))
    snapshots, commit = os.path.split(snapshot)
    repo_folder, kind = os.path.split(snapshots)
    name = os.path.basename(repo_folder)
    if kind != "snapshots" or not re.fullmatch(r"[0-9a-f]{40}", commit) or not name.startswith("models--"):
        return None
    repo_id = name.removeprefix("models--").replace("--", "/")
    return (repo_id, commit) if repo_id_error(repo_id) is None else None
