"""A LoRA module (PEFT adapters injected in place): its adapter's tensors and keys, the base model's keys, loading an
adapter saved beside the weights."""

from __future__ import annotations

import os

import torch
from safetensors.torch import load_file
from torch import nn

from ..compat import adopt_loaded_adapter

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."


def lora_config_of(module: nn.Module):
    """The LoRA config injected into `module` in place, or None."""
    configs = getattr(module, "peft_config", None)
    return configs.get("default") if isinstance(configs, dict) else None


def base_state_dict(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A state dict with PEFT's additions removed — LoRA tensors, `modules_to_save` copies (they live in the
    adapter) — and `base_layer` / `original_module` folded back: the original model's keys."""
    return {base_key(key): value for key, value in state.items()
            if ".lora_" not in key and not key.startswith("lora_") and ".modules_to_save." not in key}


def base_key(key: str) -> str:
    """A PEFT-injected module's tensor name as the original model names it."""
    return key.replace(".base_layer.", ".").replace(".original_module.", ".")


def adapter_state_dict(module: nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The adapter file's tensors: PEFT's own adapter state dict, keyed as `PeftModel.save_pretrained` keys it,
    except DoRA's magnitude, written as `...lora_magnitude_vector.weight` — a name both PEFT's loader and
    transformers' adapter auto-load map back to the parameter (transformers misses the bare name)."""
    from peft import get_peft_model_state_dict

    out = {}
    for key, value in get_peft_model_state_dict(module, state_dict=state).items():
        out[PEFT_PREFIX + key + (".weight" if key.endswith("lora_magnitude_vector") else "")] = value
    return out


def has_adapter(folder: str) -> bool:
    return os.path.isfile(os.path.join(folder, ADAPTER_CONFIG))


def load_adapter(module: nn.Module, folder: str) -> None:
    """Inject the LoRA adapter saved in `folder` into `module` in place and load its weights.

    `PreTrainedModel.from_pretrained` injects an adapter it finds beside the weights by itself; such a module is
    adopted (marked as a plain in-place injection, so that `save_pretrained` writes its base weights too) and its
    adapter weights are set again from the file by PEFT (transformers' loader misses some, e.g. DoRA's magnitude).
    """
    from peft import LoraConfig, inject_adapter_in_model, set_peft_model_state_dict

    if lora_config_of(module) is not None:
        adopt_loaded_adapter(module)
    else:
        inject_adapter_in_model(LoraConfig.from_pretrained(folder), module)
    weights = load_file(os.path.join(folder, ADAPTER_WEIGHTS))
    weights = {k[len(PEFT_PREFIX):] if k.startswith(PEFT_PREFIX) else k: v for k, v in weights.items()}
    result = set_peft_model_state_dict(module, weights)
    if getattr(result, "unexpected_keys", None):
        raise ValueError(f"adapter in {folder} has keys its module lacks: {result.unexpected_keys[:5]}")
