"""`OmniConfig`: the root `config.json` of a composed model, and the one rule for where a module's weights are.

It records the module names in order, and for each its class, its subfolder and, for a module whose weights
come from elsewhere (a released encoder loaded from a local folder, a frozen module written once to
`frozen/<module>/`), its source path. A module loaded from the Hub records that repo and the commit it was loaded
at (`hub_repo`, `hub_revision`): a composition pushed to the Hub links such a module (still frozen) instead of
uploading it again, and `trained` (set once a training run prepared the model) says whether it was changed.
"""

from __future__ import annotations

import os
import re

from transformers import PretrainedConfig


class OmniConfig(PretrainedConfig):
    """Root configuration of an `OmniModel`.

    `modules` is a list of dicts, one per module, in order:
    `{"name": "llm", "class": "LlamaForCausalLM", "subfolder": "llm", "source": None, "processor": None}`, plus
    `hub_repo` / `hub_revision` (where the Hub holds the module) and `trained` (true / false / null: unknown).
    """

    model_type = "hf_omni"

    def __init__(self, modules: list[dict] | None = None, omni_class: str | None = None, **kwargs):
        self.modules = [check_entry(dict(m)) for m in (modules or [])]
        self.omni_class = omni_class
        super().__init__(**kwargs)

    @property
    def module_names(self) -> list[str]:
        return [m["name"] for m in self.modules]

    def module_entry(self, name: str) -> dict:
        for entry in self.modules:
            if entry["name"] == name:
                return entry
        raise KeyError(f"no module named {name!r} in OmniConfig (modules: {self.module_names})")


REVISION = re.compile(r"[A-Za-z0-9][A-Za-z0-9._/-]{0,127}")


class UnsafePathError(ValueError):
    """A module path in a root config that could lead outside the folder holding it."""


def check_entry(entry: dict) -> dict:
    """The path rule of a module entry: `subfolder` is a plain folder name (no separator, no `..`, not absolute);
    `source`, when set, is an absolute path (what hf_omni records), never a relative one; `hub_repo` a Hub repo id
    and `hub_revision` a branch, tag or commit name (no `..`)."""
    name, sub, source = entry.get("name"), entry.get("subfolder"), entry.get("source")
    repo, revision = entry.get("hub_repo"), entry.get("hub_revision")
    if repo is not None:
        from huggingface_hub.utils import HFValidationError, validate_repo_id

        try:
            validate_repo_id(repo)
        except (HFValidationError, TypeError) as err:
            raise UnsafePathError(f"module {name!r}: hub_repo {repo!r} is not a Hub repo id ({err})") from None
    if revision is not None and (not isinstance(revision, str) or not REVISION.fullmatch(revision)
                                 or ".." in revision or revision.startswith("/")):
        raise UnsafePathError(f"module {name!r}: hub_revision {revision!r} is not a branch, tag or commit name")
    if not isinstance(sub, str) or sub in ("", ".", "..") or "/" in sub or "\\" in sub or os.path.isabs(sub):
        raise UnsafePathError(f"module {name!r}: subfolder {sub!r} must be a plain folder name")
    if source is not None and (not isinstance(source, str) or not os.path.isabs(source)):
        raise UnsafePathError(f"module {name!r}: source {source!r} must be an absolute path to a module folder")
    return entry


def module_folder(root: str, config: OmniConfig, name: str) -> str:
    """Where module `name` of the composed model saved at `root` is read from: its subfolder when that holds an HF
    module (a `config.json`), else its recorded source, which must be an HF module folder. The subfolder must stay
    inside `root` (a symlink leaving it is refused). A clear error naming the module otherwise."""
    entry = check_entry(config.module_entry(name))
    folder = os.path.join(root, entry["subfolder"])
    inside = os.path.realpath(root)
    if os.path.lexists(folder) and os.path.dirname(os.path.realpath(folder)) != inside:
        raise UnsafePathError(f"module {name!r}: {folder} leads outside {root}")
    if os.path.isfile(os.path.join(folder, "config.json")):
        return folder
    source = entry.get("source")
    if source and os.path.isdir(source):
        if not os.path.isfile(os.path.join(source, "config.json")):
            raise ValueError(f"module {name!r}: source {source} is not a module folder (no config.json)")
        return source
    raise FileNotFoundError(f"module {name!r}: no folder {entry['subfolder']!r} in {root} and no recorded source "
                            f"({source!r})")
