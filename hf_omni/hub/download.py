"""`OmniModel.from_pretrained("org/name")`: a composition repo from the Hub, downloaded file by file.

The root `config.json` first (its commit pins everything after it), then exactly the module files the
composition needs: the subfolders this repo holds (`hub_layout: single`) and, for every module that lives in
another repo (`hub_repo`, a module repo or a linked frozen one), that repo at its recorded commit. A `source` path
in a downloaded config is never followed: it names a folder on the machine that pushed it.
"""

from __future__ import annotations

import os

from ..compat import config_commit_hash
from ..core.config import OmniConfig
from ..files.composition import composition_of
from ..files.folder import module_patterns
from ..files.format import config_files, format_of, is_module_folder
from .ids import cache_snapshot, is_hub_id


def cached_commit(repo_id: str, config_file: str = "config.json") -> str | None:
    """The commit the local Hub cache resolved `repo_id`'s default branch to (what `from_pretrained` just read: its
    `config_file`)."""
    import re

    from huggingface_hub import try_to_load_from_cache

    path = try_to_load_from_cache(repo_id, config_file)
    commit = os.path.basename(os.path.dirname(path)) if isinstance(path, str) else None
    return commit if commit and re.fullmatch(r"[0-9a-f]{40}", commit) else None


def download_module(repo_id: str, revision: str | None, name: str, token=None, cache_dir=None,
                    subfolder: str | None = None) -> str:
    """A module's HF files from `repo_id` (in `subfolder`, or at its root); returns the local folder."""
    from huggingface_hub import snapshot_download

    prefix = f"{subfolder}/" if subfolder else ""
    local = snapshot_download(repo_id, revision=revision, token=token, cache_dir=cache_dir,
                              allow_patterns=[prefix + p for p in module_patterns()])
    folder = os.path.join(local, subfolder) if subfolder else local
    if not is_module_folder(folder):
        raise FileNotFoundError(f"module {name!r}: {repo_id}{'/' + subfolder if subfolder else ''} at "
                                f"{revision or 'main'} holds no module config "
                                f"({', '.join(config_files())}): not a module")
    return folder


def download_composition(repo_id: str, revision: str | None = None, token=None,
                         cache_dir=None) -> tuple[str, OmniConfig, dict[str, str]]:
    """The composition `repo_id` at `revision`: (local root, its config, {module: local folder})."""
    from huggingface_hub import hf_hub_download, snapshot_download

    config_path = hf_hub_download(repo_id, "config.json", revision=revision, token=token, cache_dir=cache_dir)
    root = os.path.dirname(config_path)
    commit = os.path.basename(root)  # snapshots/<commit>/config.json: the commit the rest is read at
    config = OmniConfig.from_pretrained(root)
    if config.model_type != "hf_omni" or not config.modules:
        raise ValueError(f"{repo_id}: config.json is not an hf_omni composition (model_type {config.model_type!r})")
    folders = {}
    for entry in config.modules:
        if entry.hub_repo:
            folders[entry.name] = download_module(entry.hub_repo, entry.hub_revision, entry.name, token, cache_dir)
        else:
            folders[entry.name] = download_module(repo_id, commit, entry.name, token, cache_dir,
                                                  subfolder=entry.subfolder)
    beside = composition_of(config).beside_patterns(config)  # a pipeline's scheduler, ...: at the same commit
    if beside:
        snapshot_download(repo_id, revision=commit, token=token, cache_dir=cache_dir, allow_patterns=beside)
    return root, config, folders


def linked_folders(root: str, config: OmniConfig, token=None, cache_dir=None) -> dict[str, str]:
    """For a local root config: modules it holds neither as a subfolder nor as a local source, fetched from their
    recorded Hub repo (a config written by a per-module push, copied locally)."""
    out = {}
    for entry in config.modules:
        sub = os.path.join(root, entry.subfolder)
        if entry.hub_repo and not is_module_folder(sub) and not (entry.source and os.path.isdir(entry.source)):
            out[entry.name] = download_module(entry.hub_repo, entry.hub_revision, entry.name, token,
                                                 cache_dir)
    return out


def hub_origin(module) -> dict:
    """A module loaded from the Hub: its repo (`_name_or_path`) and the commit it was loaded at (`_commit_hash`
    where transformers still records it, else the commit the cache's ref names; none found: not a link). A module
    loaded from a Hub cache snapshot (a composition repo's linked or per-module module, `download_composition`)
    came from that repo at that snapshot's commit: without this, composing it again recorded only a local source
    and a push uploaded a released module it could link."""
    fmt = format_of(module)
    path = fmt.source_path(module)  # a transformers module: its config's `_name_or_path`
    snapshot = cache_snapshot(path) if path and fmt.is_folder(path) else None
    if snapshot is not None:
        return {"hub_repo": snapshot[0], "hub_revision": snapshot[1]}
    if not path or not is_hub_id(path):
        return {}
    commit = config_commit_hash(getattr(module, "config", None)) or cached_commit(path, fmt.config_files[0])
    return {"hub_repo": path, "hub_revision": commit} if commit else {}
