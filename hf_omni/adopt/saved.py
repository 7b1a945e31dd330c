"""What an adopted model's saves hold, by name: its released format beside `hf_omni.json` (an export, or a
checkpoint's `released/` copy) and, in a checkpoint, each module's tensors beside `hf_omni_part.json`; and finding
them in a folder or a Hub repo."""

from __future__ import annotations

import os

from ..hub.ids import is_hub_id

PART_FILE = "hf_omni_part.json"  # a checkpoint's folder of an adopted model's module (its tensors, by released name)
ADOPTED_FILE = "hf_omni.json"  # beside an adopted model's released-format files: the modules= mapping and its class
RELEASED_FOLDER = "released"  # a checkpoint's copy of an adopted model in its released format


def adopted_folder(root: str, revision: str | None = None, token=None, cache_dir=None) -> bool:
    """Whether `root` (a folder or a repo id) holds an adopted model in its released format (`hf_omni.json`)."""
    if not is_hub_id(root):
        return os.path.isfile(os.path.join(root, ADOPTED_FILE))
    from huggingface_hub import HfApi

    return HfApi().file_exists(root, ADOPTED_FILE, revision=revision, token=token)


def released_files(root: str) -> str | None:
    """The folder of released-format files that `root` (an adopted model's export, or a checkpoint of one) holds;
    None for a composed model's folder."""
    for folder in (root, os.path.join(root, RELEASED_FOLDER)):
        if os.path.isfile(os.path.join(folder, ADOPTED_FILE)):
            return folder
    return None
