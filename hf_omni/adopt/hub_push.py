"""An adopted model on the Hub: one repo in the released model's own format, as its original was published.

`LlavaForConditionalGeneration.from_pretrained(repo)` loads it; `hf_omni.json` beside it (the `modules=` mapping)
lets `OmniModel.from_pretrained(repo)` adopt it again. Per-module repos of an adopted model are not written: its
modules are parts of one model, not models of their own.
"""

from __future__ import annotations

import json
import os

from ..core.config import OmniConfig
from ..files.folder import module_paths
from ..hub.checkpoint_push import folder_operations
from ..hub.commit import commit
from .saved import ADOPTED_FILE


def check_released_layout(layout: str | None) -> None:
    """`hub_layout` is for compositions: an adopted model leaves it unset (one repo, the released format)."""
    if layout is not None:
        raise ValueError(f"hub_layout: {layout!r} is for composed models; an adopted model is pushed as one repo in "
                         "its released format: leave hub_layout unset")


def released_card(folder: str, repo_id: str) -> str:
    from huggingface_hub import ModelCard, ModelCardData

    config = OmniConfig.from_json_file(os.path.join(folder, ADOPTED_FILE))
    with open(os.path.join(folder, "config.json")) as f:
        released = json.load(f)
    cls = config.adopted["class"].rsplit(".", 1)[-1]
    rows = "\n".join(f"| `{e.name}` | {', '.join(f'`{p}`' for p in e.extra['paths'])} | "
                     f"{'trained' if e.trained else 'frozen' if e.trained is False else 'not recorded'} |"
                     for e in config.modules)
    data = ModelCardData(library_name="transformers", tags=["hf_omni"])
    body = (f"# {repo_id}\n\nA `{released.get('model_type', '')}` model fine-tuned per module with hf_omni, in its "
            f"released format: `{cls}.from_pretrained(\"{repo_id}\")` loads it (LoRA merged into the weights).\n\n"
            f"| module | submodules | in this run |\n|---|---|---|\n{rows}\n\n`OmniModel.from_pretrained("
            f"\"{repo_id}\")` adopts it again with these modules (`{ADOPTED_FILE}`).\n")
    return str(ModelCard(f"---\n{data.to_yaml()}\n---\n\n{body}"))


def push_released(folder: str, repo_id: str, *, layout: str | None = None, token: str | None = None,
                  private: bool | None = None, revision: str | None = None,
                  commit_message: str = "Upload with hf_omni", extra_folders: dict[str, str] | None = None,
                  cards: bool = True) -> dict[str, str]:
    """One commit of the released-format files in `folder` (a checkpoint's too, under `extra_folders`); files an
    earlier push left at the top level (or in the checkpoint folders it writes) and this one does not write are
    deleted in it. Returns `{repo_id: commit}`."""
    from huggingface_hub import CommitOperationAdd, HfApi

    check_released_layout(layout)
    ops = [CommitOperationAdd(name, path) for name, path in sorted(module_paths(folder).items())]
    if cards:
        ops.append(CommitOperationAdd("README.md", released_card(folder, repo_id).encode()))
    checkpoint_ops, prefixes = folder_operations(extra_folders or {})
    managed = lambda p: ("/" not in p and p != ".gitattributes") or p.startswith(prefixes)  # noqa: E731
    oid = commit(HfApi(), repo_id, ops + checkpoint_ops, commit_message, "the adopted model", token, private,
                 revision, managed=managed)
    return {repo_id: oid}
