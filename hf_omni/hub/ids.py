"""The Hub's names: whether a path names a repo, and the layouts a push can take (repo ids are checked by
`config.repo_id_error`, which the root config's entries need too)."""

from __future__ import annotations

import os

from ..config import repo_id_error

LAYOUTS = ("per_module", "single")  # a repo per module plus the composition repo | one repo


def is_hub_id(path: str) -> bool:
    """Not a local folder, and shaped like a repo id."""
    return not os.path.exists(path) and not path.startswith((".", "/", "~")) and repo_id_error(path) is None
