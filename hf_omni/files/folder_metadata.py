"""The small files of a module folder that rank 0 writes beside the weights: its format's config files
(`ModuleFormat.write_config`: a transformers module's config.json with the dtype it exports in and its own class,
not a wrapper's, and its generation config; an adopted model's part: its paths), the safetensors index, the
adapter config and the processor.
"""

from __future__ import annotations

import json
import os

import torch
from torch import nn

from ..lora.adapters import ADAPTER_CONFIG, ADAPTER_WEIGHTS, lora_config_of
from .format import format_of


def export_dtype(module: nn.Module, dtypes: dict) -> torch.dtype | None:
    """What transformers records as the module's dtype (its first floating parameter's), as exported."""
    first = next(((n, p) for n, p in module.named_parameters() if p.is_floating_point()), None)
    return None if first is None else dtypes.get(first[0], first[1].dtype)


def write_metadata(module: nn.Module, folder: str, plan, processor=None, dtype=None, base: str | None = None
                   ) -> None:
    """Rank 0: the index, the format's config files (with the exported dtype), the adapter config (when the plan
    holds the adapter file) and the processor. `base`: the folder holds the adapter alone, its base written apart (`lora_base`): no config of its own (transformers then loads the adapter's
    `base_model_name_or_path`, as for any PEFT adapter folder)."""
    fmt = format_of(module)
    if base is None:
        fmt.write_config(module, folder, dtype)
    if plan.index is not None:
        with open(os.path.join(folder, fmt.weights_index), "w") as f:
            f.write(json.dumps(plan.index, indent=2, sort_keys=True) + "\n")
    lora = lora_config_of(module) if ADAPTER_WEIGHTS in plan.files else None
    stale = (ADAPTER_CONFIG, ADAPTER_WEIGHTS) if lora is None else (*fmt.config_files, *fmt.other_files) \
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
