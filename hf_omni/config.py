"""`OmniConfig`: the root `config.json` of a composed model, and the one rule for where a module's weights are.

It records the module names in order, and for each its class, its subfolder and, for a module whose weights
come from elsewhere (a released encoder loaded from a local folder, a frozen module written once to
`frozen/<module>/`), its source path.
"""

from __future__ import annotations

import os

from transformers import PretrainedConfig


class OmniConfig(PretrainedConfig):
    """Root configuration of an `OmniModel`.

    `modules` is a list of dicts, one per module, in order:
    `{"name": "llm", "class": "LlamaForCausalLM", "subfolder": "llm", "source": None, "processor": None}`.
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


class UnsafePathError(ValueError):
    """A module path in a root config that could lead outside the folder holding it."""


def check_entry(entry: dict) -> dict:
    """The path rule of a module entry: `subfolder` is a plain folder name (no separator, no `..`, not absolute);
    `source`, when set, is an absolute path (what hf_omni records), never a relative one."""
    name, sub, source = entry.get("name"), entry.get("subfolder"), entry.get("source")
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
