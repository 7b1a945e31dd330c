"""Write and read one module as a Hugging Face folder (config, weights, processor, LoRA adapter).

A module wrapped in place (FSDP2 / composable replicate) has a generated subclass; the folder records
the module's original class so that `AutoModel*.from_pretrained(folder)` and `OmniModel` find it.
A LoRA module (adapters injected in place with PEFT) is written as its base weights plus
`adapter_config.json` + `adapter_model.safetensors`, as `PeftModel.save_pretrained` would write them.
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import nn

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."
PROCESSOR_KINDS = ("tokenizer", "processor", "image_processor", "feature_extractor")


def _wrapper_classes() -> tuple[type, ...]:
    from torch.distributed._composable.replicate import DDP
    from torch.distributed.fsdp import FSDPModule

    return (FSDPModule, DDP)


def original_class(module: nn.Module) -> type:
    """The module's own class, under any in-place wrapper subclass (`FSDPLlama...`, `DDPLlama...`)."""
    wrappers = _wrapper_classes()
    cls = type(module)
    while len(cls.__bases__) == 2 and cls.__bases__[0] in wrappers:
        cls = cls.__bases__[1]
    return cls


def lora_config_of(module: nn.Module):
    """The LoRA config injected into `module` in place, or None."""
    configs = getattr(module, "peft_config", None)
    return configs.get("default") if isinstance(configs, dict) else None


def base_state_dict(module: nn.Module) -> dict[str, torch.Tensor]:
    """`module.state_dict()` with LoRA adapters removed and `base_layer` folded back: the original keys."""
    out = {}
    for key, value in module.state_dict().items():
        if ".lora_" in key or key.startswith("lora_"):
            continue
        out[key.replace(".base_layer.", ".")] = value
    return out


def merged_state_dict(module: nn.Module) -> dict[str, torch.Tensor]:
    """Base weights with every LoRA delta added in: a plain model's state dict."""
    from peft.tuners.lora import LoraLayer

    state = base_state_dict(module)
    for name, sub in module.named_modules():
        if isinstance(sub, LoraLayer) and "default" in sub.lora_A:
            key = f"{name}.weight"
            state[key] = state[key] + sub.get_delta_weight("default").to(state[key].dtype)
    return state


def _fix_architectures(folder: str, cls: type) -> None:
    path = os.path.join(folder, "config.json")
    with open(path) as f:
        config = json.load(f)
    if config.get("architectures") != [cls.__name__]:
        config["architectures"] = [cls.__name__]
        with open(path, "w") as f:
            json.dump(config, f, indent=2, sort_keys=True)


def processor_kind(processor: Any) -> str:
    from transformers import FeatureExtractionMixin, ImageProcessingMixin, PreTrainedTokenizerBase, ProcessorMixin

    if isinstance(processor, PreTrainedTokenizerBase):
        return "tokenizer"
    if isinstance(processor, ProcessorMixin):
        return "processor"
    if isinstance(processor, ImageProcessingMixin):
        return "image_processor"
    if isinstance(processor, FeatureExtractionMixin):
        return "feature_extractor"
    raise TypeError(f"unsupported processor type {type(processor).__name__}")


def save_module(module: nn.Module, folder: str, processor: Any = None, merge_lora: bool = False,
                state_dict: dict[str, torch.Tensor] | None = None) -> None:
    """Write `module` to `folder` in HF format (LoRA: base weights + adapter files beside them)."""
    os.makedirs(folder, exist_ok=True)
    lora = lora_config_of(module)
    if state_dict is None:
        state_dict = merged_state_dict(module) if (lora and merge_lora) else base_state_dict(module)
    state_dict = {k: v.detach().contiguous() for k, v in state_dict.items()}
    module.save_pretrained(folder, state_dict=state_dict)
    _fix_architectures(folder, original_class(module))
    for stale in (ADAPTER_CONFIG, ADAPTER_WEIGHTS):
        if os.path.exists(os.path.join(folder, stale)):
            os.remove(os.path.join(folder, stale))
    if lora is not None and not merge_lora:
        from peft import get_peft_model_state_dict

        adapter = {PEFT_PREFIX + k: v.detach().contiguous() for k, v in get_peft_model_state_dict(module).items()}
        lora.base_model_name_or_path = None
        lora.save_pretrained(folder)
        save_file(adapter, os.path.join(folder, ADAPTER_WEIGHTS), metadata={"format": "pt"})
    if processor is not None:
        processor.save_pretrained(folder)


def has_adapter(folder: str) -> bool:
    return os.path.isfile(os.path.join(folder, ADAPTER_CONFIG))


def load_adapter(module: nn.Module, folder: str) -> None:
    """Inject the LoRA adapter saved in `folder` into `module` in place and load its weights.

    `PreTrainedModel.from_pretrained` loads an adapter it finds beside the weights by itself; such a module is
    adopted as is (marked as a plain in-place injection, so that `save_pretrained` writes its base weights too).
    """
    from peft import LoraConfig, inject_adapter_in_model, set_peft_model_state_dict

    if lora_config_of(module) is not None:
        module._hf_peft_config_loaded = False
        return

    config = LoraConfig.from_pretrained(folder)
    inject_adapter_in_model(config, module)
    weights = load_file(os.path.join(folder, ADAPTER_WEIGHTS))
    weights = {k[len(PEFT_PREFIX):] if k.startswith(PEFT_PREFIX) else k: v for k, v in weights.items()}
    result = set_peft_model_state_dict(module, weights)
    if getattr(result, "unexpected_keys", None):
        raise ValueError(f"adapter in {folder} has keys its module lacks: {result.unexpected_keys[:5]}")


def load_processor(folder: str, kind: str):
    from transformers import AutoFeatureExtractor, AutoImageProcessor, AutoProcessor, AutoTokenizer

    auto = {"tokenizer": AutoTokenizer, "processor": AutoProcessor, "image_processor": AutoImageProcessor,
            "feature_extractor": AutoFeatureExtractor}[kind]
    return auto.from_pretrained(folder)
