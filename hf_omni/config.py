"""`OmniConfig`: the root `config.json` of a composed model.

It records the module names in order, and for each its class, its subfolder and, for a module whose
weights come from elsewhere (a released encoder loaded from a local folder), its source path.
"""

from __future__ import annotations

from transformers import PretrainedConfig


class OmniConfig(PretrainedConfig):
    """Root configuration of an `OmniModel`.

    `modules` is a list of dicts, one per module, in order:
    `{"name": "llm", "class": "LlamaForCausalLM", "subfolder": "llm", "source": None}`.
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
