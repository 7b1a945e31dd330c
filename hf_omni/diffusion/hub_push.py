"""A diffusers pipeline on the Hub: one repo in diffusers' own layout, as its original was published.

`model_index.json` at the root and every component in its folder, so `PipelineClass.from_pretrained(repo)` loads it;
the root `config.json` beside it lets `MyModel.from_pretrained(repo)` (or `from_pipeline(PipelineClass, repo)`)
rebuild the composed model. Every component is uploaded, frozen released ones too: `model_index.json` names a
class per component, never another repo, so nothing can be linked. A pipeline with LoRA also carries
`pytorch_lora_weights.safetensors`, which `PipelineClass.from_pretrained(base).load_lora_weights(repo)` loads.
"""

from __future__ import annotations

import json
import os

from ..core.config import OmniConfig
from ..hub.checkpoint_push import folder_operations
from ..hub.commit import commit
from .index import INDEX

LORA_FILE = "pytorch_lora_weights.safetensors"


def pipeline_export(root: str) -> bool:
    """Whether `root` is a pipeline folder (`model_index.json` at its root: an export, never a checkpoint)."""
    return os.path.isfile(os.path.join(root, INDEX))


def check_pipeline_layout(layout: str | None) -> None:
    if layout not in (None, "single"):
        raise ValueError(f"hub_layout: {layout!r}: a diffusers pipeline is pushed as one repo in diffusers' layout "
                         "(model_index.json cannot point at other repos): leave hub_layout unset")


def pipeline_card(root: str, repo_id: str) -> str:
    from huggingface_hub import ModelCard, ModelCardData

    config = OmniConfig.from_pretrained(root)
    with open(os.path.join(root, INDEX)) as f:
        cls = json.load(f)["_class_name"]
    runs = {True: "trained", False: "frozen", None: "not recorded"}
    rows = "\n".join(f"| `{e.name}` | `{e.cls}` | {runs[e.trained]} |" for e in config.modules)
    lora = os.path.isfile(os.path.join(root, LORA_FILE))
    data = ModelCardData(library_name="diffusers", tags=["hf_omni", "diffusers", cls])
    body = (f"# {repo_id}\n\nA `{cls}` trained per component with hf_omni, in diffusers' own layout:\n\n```python\n"
            f"from diffusers import {cls}\n\npipeline = {cls}.from_pretrained(\"{repo_id}\")\n```\n\n"
            f"| component | class | in this run |\n|---|---|---|\n{rows}\n\nEvery component is in this repo, frozen "
            "ones too (`model_index.json` cannot point at another repo).")
    if lora:
        body += (f" LoRA adapters are merged into their components, and also in `{LORA_FILE}`: "
                 f"`{cls}.from_pretrained(base).load_lora_weights(\"{repo_id}\")`.")
    return str(ModelCard(f"---\n{data.to_yaml()}\n---\n\n{body}\n"))


def push_pipeline(root: str, repo_id: str, *, layout: str | None = None, token: str | None = None,
                  private: bool | None = None, revision: str | None = None,
                  commit_message: str = "Upload with hf_omni", extra_folders: dict[str, str] | None = None,
                  cards: bool = True) -> dict[str, str]:
    """One commit of the pipeline folder `root` (every regular file under it but the run's `training_summary.json`),
    replacing what an earlier push wrote at those paths. Returns `{repo_id: commit}`."""
    from huggingface_hub import CommitOperationAdd, HfApi

    check_pipeline_layout(layout)
    ops, tops = [], set()
    for folder, dirs, names in os.walk(root):
        dirs[:] = sorted(d for d in dirs if not d.startswith(".") and not os.path.islink(os.path.join(folder, d)))
        for name in sorted(names):
            path = os.path.join(folder, name)
            rel = os.path.relpath(path, root).replace(os.sep, "/")
            if os.path.islink(path) or name.startswith(".") or rel in ("README.md", "training_summary.json"):
                continue
            ops.append(CommitOperationAdd(rel, path))
            tops.add(rel.split("/")[0])
    if cards:
        ops.append(CommitOperationAdd("README.md", pipeline_card(root, repo_id).encode()))
    checkpoint_ops, prefixes = folder_operations(extra_folders or {})
    managed = lambda p: "/" not in p or p.split("/")[0] in tops or p.startswith(prefixes)  # noqa: E731
    oid = commit(HfApi(), repo_id, ops + checkpoint_ops, commit_message, "the pipeline", token, private, revision,
                 managed=lambda p: managed(p) and p != ".gitattributes")
    return {repo_id: oid}
