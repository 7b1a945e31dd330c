"""The transformers format: a `PreTrainedModel` (a class of transformers, of hf_omni, registered with
`register_module_class` or with an Auto class) in the folder its `save_pretrained` writes: `config.json` (the
module's own class in `architectures`, never a wrapper's), `generation_config.json`, `model.safetensors` or shards
with `model.safetensors.index.json`."""

from __future__ import annotations

import copy
import json
import os

import torch
from torch import nn
from transformers import PreTrainedModel

from ..compat import config_name_or_path, keys_to_ignore_on_save, transformers_save_keys
from ..files.empty_init import apply_dtype_plan, load_generation_config, saved_dtype
from ..files.format import ModuleFormat, register_module_format
from ..files.meta import meta_build
from ..files.safetensors_index import SafetensorsIndex
from . import transformers_classes as classes

AUTO_CLASSES = (("MODEL_FOR_CAUSAL_LM_MAPPING_NAMES", "AutoModelForCausalLM"),
                ("MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES", "AutoModelForImageTextToText"),
                ("MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES", "AutoModelForSeq2SeqLM"),
                ("MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES", "AutoModelForImageClassification"),
                ("MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES", "AutoModelForSequenceClassification"),
                ("MODEL_MAPPING_NAMES", "AutoModel"))
# config keys that say where or how a module was saved or run, not what it is (`use_cache`: Trainer's switch,
# which OmniTrainer sets on every module as Trainer sets it on its one model)
BOOKKEEPING = {"_name_or_path", "name_or_path", "transformers_version", "architectures", "_commit_hash", "use_cache"}


def record_original_class(folder: str, cls: type) -> None:
    """`save_pretrained` of a wrapped module records the wrapper subclass; record the module's own class."""
    path = os.path.join(folder, "config.json")
    with open(path) as f:
        config = json.load(f)
    if config.get("architectures") != [cls.__name__]:
        config["architectures"] = [cls.__name__]
        with open(path, "w") as f:
            json.dump(config, f, indent=2, sort_keys=True)


def auto_class(class_name: str) -> tuple[str, bool]:
    """The Auto class that loads `class_name`, and whether `import hf_omni` must come first (its own
    registered classes, e.g. `Projector`)."""
    from transformers.models.auto import modeling_auto

    for mapping, auto in AUTO_CLASSES:
        if class_name in getattr(modeling_auto, mapping, {}).values():
            return auto, False
    return "AutoModel", True


@register_module_format
class TransformersFormat(ModuleFormat):
    name = "transformers"
    description = "a transformers `PreTrainedModel` in the folder its `save_pretrained` writes"
    config_files = ("config.json",)
    other_files = ("generation_config.json",)
    library_name = "transformers"

    def handles(self, cls: type) -> bool:
        return issubclass(cls, PreTrainedModel)

    def class_record(self, cls: type, module: str) -> str:
        return classes.class_record(cls, module)

    def resolve(self, record: str) -> type | None:
        return classes.find_module_class(record)

    def load(self, cls: type, folder: str, **kwargs) -> nn.Module:
        return cls.from_pretrained(folder, **kwargs)

    def build_empty(self, cls: type, folder: str, name_or_path: str) -> nn.Module:
        """Saved dtype, parameters on meta and buffers computed, tied, keep-in-fp32 dtype plan, generation config:
        what `from_pretrained` gives a loaded model before it reads the weights (docs/from_pretrained.md)."""
        config = cls.config_class.from_pretrained(folder)
        config.name_or_path = name_or_path
        dtype = saved_dtype(config)
        module = meta_build(cls, config, dtype, include_buffers=False)
        module.tie_weights()
        apply_dtype_plan(module, dtype or torch.get_default_dtype())
        load_generation_config(module, folder)
        return module

    def empty_copy(self, module: nn.Module) -> nn.Module:
        return meta_build(classes.original_class(module), copy.deepcopy(module.config), None, include_buffers=False)

    def write_config(self, module: nn.Module, folder: str, dtype=None) -> None:
        """config.json (with the exported dtype and the module's own class) and the generation config."""
        view, cls = self.save_view(module), classes.original_class(module)
        config = view.config
        config.architectures = [cls.__name__]
        if dtype is not None:
            config.dtype = dtype
        config.save_pretrained(folder)
        if view.can_generate() and getattr(view, "generation_config", None) is not None:
            view.generation_config.save_pretrained(folder)
        record_original_class(folder, cls)

    def save_view(self, module: nn.Module) -> nn.Module:
        return classes.save_view(module)

    def keys_to_ignore(self, view: nn.Module) -> list[str]:
        return keys_to_ignore_on_save(view)

    def convert_keys(self, view: nn.Module, state: dict) -> dict:
        return transformers_save_keys(view, state)

    def source_path(self, module: nn.Module) -> str:
        return config_name_or_path(module.config)

    def card_usage(self, record: str, repo_id: str, subfolder: str | None) -> list[str]:
        auto, needs_import = auto_class(record)
        where = f'"{repo_id}"' + (f', subfolder="{subfolder}"' if subfolder else "")
        return ["This module alone:", "", "```python", *(["import hf_omni  # registers its classes"] if needs_import
                                                          else []),
                f"from transformers import {auto}", "", f"model = {auto}.from_pretrained({where})", "```", ""]

    def rebuild_difference(self, cls: type, folder: str, origin: str) -> str | None:
        """The configs compared without bookkeeping keys, each with the dtype `dtype="auto"` loads it in."""

        ours, theirs = (cls.config_class.from_pretrained(f).to_dict() for f in (folder, origin))
        for config, where in ((ours, folder), (theirs, origin)):
            for key in BOOKKEEPING:
                config.pop(key, None)
            config["dtype"] = config.get("dtype") or SafetensorsIndex.for_weights(where).first_float_dtype()
        if ours != theirs:
            return "config: " + ", ".join(sorted(k for k in set(ours) | set(theirs) if ours.get(k) != theirs.get(k)))
        return None
