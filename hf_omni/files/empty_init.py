"""`empty_init`: a module built on the meta device by its format (`ModuleFormat.build_empty`), then given what
`PreTrainedModel.from_pretrained` gives a loaded model, step by step (docs/from_pretrained.md lists every step and
what hf_omni does for it; the first four are the transformers format's, `formats.transformers`).

    build (saved dtype, parameters on meta, buffers computed) -> tie weights -> keep-in-fp32 dtype plan
    -> generation config -> LoRA adapter injected (on meta)          [build_empty, at from_pretrained]
    ... wrapped (sharded on meta) ...
    -> allocate on the device, tied parameters allocated once          [materialize, in weights.fill_module]
    -> read from the files, missing ones initialised by the model

Accelerate's `init_empty_weights` re-creates every parameter it sees registered, so the ties `post_init` makes
are undone there, and `Module.to_empty` allocates each module's parameters apart: both are redone here.
"""

from __future__ import annotations

import os
import re

import torch
from torch import nn

from ..compat import keep_in_fp32_plan, own_tensors
from ..lora.adapters import has_adapter
from .format import format_of
from .lora_base import weights_folder


def saved_dtype(config) -> torch.dtype | None:
    """What `from_pretrained(folder)` builds a module in (`dtype="auto"`): the dtype its config records."""
    dtype = getattr(config, "dtype", None)
    dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    return dtype if isinstance(dtype, torch.dtype) and dtype.is_floating_point else None


def build_empty(module_cls, folder: str) -> nn.Module:
    """The module of `folder` with parameters on the meta device and real buffers, as its format's loading builds
    it (`ModuleFormat.build_empty`: a transformers model tied, in its loading dtypes, with its generation config);
    a LoRA adapter beside the weights is injected, empty too."""

    weights = weights_folder(folder)  # a LoRA checkpoint's folder: its config is its base's
    module = format_of(module_cls).build_empty(module_cls, weights, folder)
    if has_adapter(folder):
        from peft import LoraConfig, inject_adapter_in_model

        inject_adapter_in_model(LoraConfig.from_pretrained(folder), module)
    return module.eval()


def apply_dtype_plan(module: nn.Module, dtype: torch.dtype) -> list[str]:
    """`_keep_in_fp32_modules` (fp16 loads) and `_keep_in_fp32_modules_strict` (fp16 and bf16 loads): the matching
    parameters and persistent buffers in float32, as `from_pretrained` loads them. Returns their names."""
    patterns = keep_in_fp32_plan(module, dtype)
    if not patterns:
        return []
    match = re.compile("|".join(f"(?:{p.replace('*', '.*')})" for p in patterns))
    persistent = set(module.state_dict(keep_vars=True))
    changed, done = [], {}
    for owner_name, owner in module.named_modules():
        for table, attr, tensor in own_tensors(owner):
            name = f"{owner_name}.{attr}" if owner_name else attr
            if not tensor.is_floating_point() or name not in persistent or not match.search(name):
                continue
            if id(tensor) not in done:
                value = torch.empty_like(tensor, dtype=torch.float32) if tensor.is_meta else tensor.float()
                done[id(tensor)] = (nn.Parameter(value, requires_grad=tensor.requires_grad)
                                    if isinstance(tensor, nn.Parameter) else value)
            table[attr] = done[id(tensor)]
            changed.append(name)
    return changed


def load_generation_config(module: nn.Module, folder: str) -> None:
    """The folder's `generation_config.json`, as `from_pretrained` reads it for a model that can generate."""
    if not os.path.isfile(os.path.join(folder, "generation_config.json")) or not module.can_generate():
        return
    from transformers import GenerationConfig

    module.generation_config = GenerationConfig.from_pretrained(folder)


@torch.no_grad()
def materialize(module: nn.Module, device: torch.device) -> None:
    """`Module.to_empty(device)` that allocates a tied parameter once and gives it to every module holding it
    (DTensor parameters of a sharded module: their local shards only)."""
    made: dict[int, torch.Tensor] = {}
    for owner in module.modules():
        for table, attr, tensor in own_tensors(owner):
            if not tensor.is_meta:
                continue
            if id(tensor) not in made:
                value = torch.empty_like(tensor, device=device)
                made[id(tensor)] = (nn.Parameter(value, requires_grad=tensor.requires_grad)
                                    if isinstance(tensor, nn.Parameter) else value)
            table[attr] = made[id(tensor)]
