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


def is_sharded(module: nn.Module) -> bool:
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in module.parameters())


def full_state_dict(module: nn.Module) -> dict[str, torch.Tensor]:
    """The module's full state dict. A sharded (FSDP2) module is gathered — a collective every rank must join —
    and only rank 0 receives the tensors (on CPU, one at a time); other ranks get `{}`."""
    if not is_sharded(module):
        return module.state_dict()
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def base_state_dict(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A state dict with LoRA adapters removed and `base_layer` folded back: the original keys."""
    return {key.replace(".base_layer.", "."): value for key, value in state.items()
            if ".lora_" not in key and not key.startswith("lora_")}


def merged_state_dict(module: nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Base weights with every LoRA delta (B @ A x scaling) added in: a plain model's state dict."""
    from peft.tuners.lora import Linear as LoraLinear
    from peft.utils.other import transpose

    merged = base_state_dict(state)
    for name, sub in module.named_modules():
        if isinstance(sub, LoraLinear) and "default" in sub.lora_A:
            a, b = state[f"{name}.lora_A.default.weight"], state[f"{name}.lora_B.default.weight"]
            delta = transpose(b.float() @ a.float(), sub.fan_in_fan_out) * sub.scaling["default"]
            merged[f"{name}.weight"] = merged[f"{name}.weight"] + delta.to(merged[f"{name}.weight"].dtype)
        elif hasattr(sub, "lora_A") and "default" in getattr(sub, "lora_A", {}):
            raise NotImplementedError(f"merging LoRA into {type(sub).__name__} layers ({name}) is not supported")
    return merged


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
                is_main_process: bool = True, executor=None):
    """Write `module` to `folder` in HF format (LoRA: base weights + adapter files beside them). Every rank calls it
    (a sharded module is gathered); only the main process writes. With an `executor`, the tensors are copied now
    and written in the background: returns the future."""
    state = full_state_dict(module)
    if not is_main_process:
        return None
    lora = lora_config_of(module)
    weights = merged_state_dict(module, state) if (lora and merge_lora) else base_state_dict(state)
    adapter = None
    if lora is not None and not merge_lora:
        from peft import get_peft_model_state_dict

        adapter = {PEFT_PREFIX + k: v for k, v in get_peft_model_state_dict(module, state_dict=state).items()}
    copy = executor is not None  # training goes on while the files are written: write a snapshot
    weights, adapter = (_cpu(t, copy) if t is not None else None for t in (weights, adapter))
    write = lambda: _write_module_files(module, folder, weights, lora, adapter, processor)  # noqa: E731
    return executor.submit(write) if executor is not None else write()


def _cpu(tensors: dict[str, torch.Tensor], copy: bool) -> dict[str, torch.Tensor]:
    return {k: (v.detach().to("cpu", copy=copy)).contiguous() for k, v in tensors.items()}


def _write_module_files(module, folder, weights, lora, adapter, processor) -> None:
    os.makedirs(folder, exist_ok=True)
    module.save_pretrained(folder, state_dict=weights)
    _fix_architectures(folder, original_class(module))
    for stale in (ADAPTER_CONFIG, ADAPTER_WEIGHTS):
        if os.path.exists(os.path.join(folder, stale)):
            os.remove(os.path.join(folder, stale))
    if adapter is not None:
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
