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
        self.modules = [dict(m) for m in (modules or [])]
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


def module_folder(root: str, config: OmniConfig, name: str) -> str:
    """Where module `name` of the composed model saved at `root` is read from: its subfolder when that holds an HF
    module (a `config.json`), else its recorded source. A clear error naming the module when neither exists."""
    entry = config.module_entry(name)
    folder = os.path.join(root, entry["subfolder"])
    if os.path.isfile(os.path.join(folder, "config.json")):
        return folder
    source = entry.get("source")
    if source and os.path.isdir(source):
        return source
    raise FileNotFoundError(f"module {name!r}: no folder {entry['subfolder']!r} in {root} and no recorded source "
                            f"({source!r})")
