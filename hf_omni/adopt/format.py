"""The adopted part's format: a module of an adopted model (`adopt.parts.Part`, the released model's submodules
under their released names). Its checkpoint folder holds its tensors under the released model's keys (the released
class's save-time conversion) and `hf_omni_part.json` (its paths) instead of a config. The whole adopted model is
its composition's (`compositions/adopted.py`)."""

from __future__ import annotations

import json
import os

from torch import nn

from ..compat import keys_to_ignore_on_save, transformers_save_keys
from ..files.format import ModuleFormat, register_module_format
from .parts import Part
from .saved import PART_FILE


@register_module_format
class PartFormat(ModuleFormat):
    name = "adopted part"
    description = "a module of an adopted model: the released model's submodules under their released names"
    config_files = (PART_FILE,)
    library_name = "transformers"
    exported = False  # its folder is a checkpoint's: an export holds the released format (`adopt.export`)

    def handles(self, cls: type) -> bool:
        return issubclass(cls, Part)

    def class_record(self, cls: type, module: str) -> str:
        raise ValueError(f"module {module!r} is a module of an adopted model: its model records the released class")

    def write_config(self, module: nn.Module, folder: str, dtype=None) -> None:
        with open(os.path.join(folder, PART_FILE), "w") as f:
            json.dump({"paths": module.omni_paths}, f)

    def keys_to_ignore(self, view: nn.Module) -> list[str]:
        return keys_to_ignore_on_save(view)

    def convert_keys(self, view: nn.Module, state: dict) -> dict:
        """Its tensors go through the released model's conversion: its files key them as the released files do."""
        return transformers_save_keys(view.omni_released, state)

    def checkpointed_models(self, module: nn.Module) -> list[tuple[nn.Module, list[nn.Module]]]:
        """Each of its roots that is a `PreTrainedModel` supporting it (LLaVA's `model.language_model`), else the
        outermost such models inside the root, with the carved-out submodules inside each (they keep their own
        setting); a root with none (`lm_head`) has nothing to recompute."""
        found = []
        for root in module.omni_roots:
            carved = [root.module.get_submodule(c) for c in root.carved]
            for model in _outermost(root.module, {id(c) for c in carved}):
                inside = {id(m) for m in model.modules()}
                found.append((model, [c for c in carved if id(c) in inside]))
        return found

    def no_checkpointing_reason(self, module: nn.Module) -> str:
        return (f"none of its paths {[r.path for r in module.omni_roots]} is or holds a transformers model that "
                "supports it (gradient checkpointing)")


def _supports(module: nn.Module) -> bool:
    from transformers import PreTrainedModel

    return isinstance(module, PreTrainedModel) and bool(getattr(module, "supports_gradient_checkpointing", False))


def _outermost(module: nn.Module, skip: set[int]) -> list[nn.Module]:
    if id(module) in skip:
        return []
    if _supports(module):
        return [module]
    return [found for child in module.children() for found in _outermost(child, skip)]
