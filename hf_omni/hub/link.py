"""Whether a frozen module loaded from the Hub may be linked (its repo at the recorded commit) instead of uploaded.

It may whenever loading that repo at that commit with the module's class rebuilds the module as pushed: the same
config (its format says how configs compare: `ModuleFormat.rebuild_difference`), every tensor the module has equal (dtype, shape, values), and its processor the same as the repo's. Keys
only in the repo's files (a non-persistent buffer such as BERT's `position_ids`, a pooler the module was built
without, keys the class renames on load) do not count against it.

Decided on the pushing rank from files alone, one tensor at a time: the pushed module folder against the repo's
files in the local Hub cache (what the load downloaded), never downloading anything. Origin files that are not
cached (pushing from another machine) mean an upload.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile

import torch

from ..core.errors import DamagedFileError
from ..files.empty_init import build_empty
from ..files.folder import load_processor
from ..files.format import format_of, resolve_class
from ..files.safetensors_index import SafetensorsIndex
from ..files.saved_keys import file_layout, module_tensors

logger = logging.getLogger(__name__)


def cached_origin(repo_id: str, revision: str | None, config_file: str = "config.json") -> str | None:
    """The local Hub cache's snapshot folder of `repo_id` at `revision`, or None when the cache has none: found by
    its config file alone, so that a snapshot holding only some of the repo's files (hf_omni's own downloads fetch a
    module's files, `allow_patterns`) counts; a file the comparison needs and the snapshot lacks means an upload."""
    from huggingface_hub import try_to_load_from_cache

    if not revision:
        return None
    path = try_to_load_from_cache(repo_id, config_file, revision=revision)
    return os.path.dirname(path) if isinstance(path, str) else None


def rebuilds_from_origin(folder: str, class_record: str, repo_id: str, revision: str | None,
                         processor_kind: str | None, name: str) -> bool:
    """Whether `repo_id` at `revision`, loaded with the module's class (and its processor kind), gives what `folder`
    holds (see the module docstring)."""

    fmt = format_of(resolve_class(class_record, name))
    origin = cached_origin(repo_id, revision, fmt.config_files[0])
    if origin is None or not fmt.is_folder(origin):
        logger.info("hf_omni: module %r: %s@%s is not in the local Hub cache; uploading it", name, repo_id, revision)
        return False
    try:
        why = _difference(folder, origin, class_record, processor_kind, name)
    except (FileNotFoundError, DamagedFileError) as err:  # a file the load did not cache: nothing is downloaded
        why = f"a file it needs is not in the local Hub cache ({err})"
    if why:
        logger.info("hf_omni: module %r differs from %s@%s (%s); uploading it", name, repo_id, revision, why)
    return not why


def _difference(folder: str, origin: str, class_record: str, processor_kind: str | None, name: str) -> str | None:
    cls = resolve_class(class_record, name)
    mine, repo = SafetensorsIndex.for_weights(folder), SafetensorsIndex.for_weights(origin)
    why = format_of(cls).rebuild_difference(cls, folder, origin)  # its configuration (transformers: config.json)
    if why:
        return why
    module = build_empty(cls, folder)
    layout = file_layout(module)
    tensors = module_tensors(module)
    if set(tensors) - set(layout):
        return "tensors its files do not hold as they are"
    for tensor, (_, keys) in layout.items():
        a = next((k for k in keys if k in mine), None)
        b = next((k for k in keys if k in repo), None)
        if a is None or b is None:
            return f"{tensor} is missing"
        x, y = mine.read(a), repo.read(b)
        if x.dtype != y.dtype or x.shape != y.shape or not torch.equal(x, y):
            return f"{tensor} differs"
    if processor_kind is not None and not _same_processor(processor_kind, folder, origin):
        return "its processor"
    return None


def _same_processor(kind: str, folder: str, origin: str) -> bool:
    """Both processors loaded and saved again compare equal file by file (saving normalises the files; a fast
    tokenizer's `truncation` / `padding` are per-call state its wrapper sets on every call, not part of it)."""

    with tempfile.TemporaryDirectory() as a, tempfile.TemporaryDirectory() as b:
        try:
            load_processor(origin, kind).save_pretrained(b)
        except (OSError, ValueError):  # the repo has no such processor: the pushed one is not from it
            return False
        load_processor(folder, kind).save_pretrained(a)
        names = sorted(os.listdir(a))
        return names == sorted(os.listdir(b)) and all(
            _saved_file(os.path.join(a, n)) == _saved_file(os.path.join(b, n)) for n in names)


def _saved_file(path: str):
    with open(path, "rb") as f:
        data = f.read()
    if not path.endswith(".json"):
        return data
    value = json.loads(data)
    if os.path.basename(path) == "tokenizer.json" and isinstance(value, dict):
        value.pop("truncation", None)
        value.pop("padding", None)
    return value
