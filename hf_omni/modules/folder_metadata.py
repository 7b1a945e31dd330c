"""The small files of a module folder that rank 0 writes beside the weights: config.json (with the dtype the module
exports in, and the module's own class, not a wrapper's), the generation config, the safetensors index, the adapter
config and the processor; an adopted model's part records its paths instead.
"""

from __future__ import annotations

import json
import os

import torch
from torch import nn

from ..config import PART_FILE
from .classes import original_class, save_view
from .folder_plan import INDEX
from .lora import ADAPTER_CONFIG, ADAPTER_WEIGHTS, lora_config_of


def record_original_class(folder: str, cls: type) -> None:
    """`save_pretrained` of a wrapped module records the wrapper subclass; record the module's own class."""
    path = os.path.join(folder, "config.json")
    with open(path) as f:
        config = json.load(f)
    if config.get("architectures") != [cls.__name__]:
        config["architectures"] = [cls.__name__]
        with open(path, "w") as f:
            json.dump(config, f, indent=2, sort_keys=True)


def export_dtype(module: nn.Module, dtypes: dict) -> torch.dtype | None:
    """What transformers records as the module's dtype (its first floating parameter's), as exported."""
    first = next(((n, p) for n, p in module.named_parameters() if p.is_floating_point()), None)
    return None if first is None else dtypes.get(first[0], first[1].dtype)


def write_metadata(module: nn.Module, folder: str, plan, processor=None, dtype=None, base: str | None = None
                   ) -> None:
    """Rank 0: the index, config.json (with the exported dtype), the generation config, the class record, the
    adapter config (when the plan holds the adapter file) and the processor. `base`: the folder holds the adapter
    alone, its base written apart (`lora_base`): no config of its own (transformers then loads the adapter's
    `base_model_name_or_path`, as for any PEFT adapter folder)."""
    view = save_view(module)
    if base is None and not hasattr(view, "can_generate"):  # a module of an adopted model: its paths, no class
        with open(os.path.join(folder, PART_FILE), "w") as f:
            json.dump({"paths": view.omni_paths}, f)
    elif base is None:
        config = view.config
        config.architectures = [original_class(module).__name__]
        if dtype is not None:
            config.dtype = dtype
        config.save_pretrained(folder)
        if view.can_generate() and getattr(view, "generation_config", None) is not None:
            view.generation_config.save_pretrained(folder)
        record_original_class(folder, original_class(module))
    if plan.index is not None:
        with open(os.path.join(folder, INDEX), "w") as f:
            f.write(json.dumps(plan.index, indent=2, sort_keys=True) + "\n")
    lora = lora_config_of(module) if ADAPTER_WEIGHTS in plan.files else None
    stale = (ADAPTER_CONFIG, ADAPTER_WEIGHTS) if lora is None else ("config.json", "generation_config.json") \
        if base is not None else ()
    for name in stale:
        if os.path.exists(os.path.join(folder, name)):
            os.remove(os.path.join(folder, name))
    if lora is not None:
        lora.base_model_name_or_path = base
        lora.save_pretrained(folder)
        lora.base_model_name_or_path = None
    if processor is not None:
        processor.save_pretrained(folder)
