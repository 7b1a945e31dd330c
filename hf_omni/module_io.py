"""One module as a Hugging Face folder: write it (config, weights, processor, LoRA adapter), build it back
(whole, or on the meta device for `empty_init`), copy it.

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

from .compat import adopt_loaded_adapter, in_place_wrapper_classes, lora_linear_class, lora_linear_delta

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."
PROCESSOR_KINDS = ("tokenizer", "processor", "image_processor", "feature_extractor")


def original_class(module: nn.Module) -> type:
    """The module's own class, under any in-place wrapper subclass (`FSDPLlama...`, `DDPLlama...`)."""
    wrappers = in_place_wrapper_classes()
    cls = type(module)
    while len(cls.__bases__) == 2 and cls.__bases__[0] in wrappers:
        cls = cls.__bases__[1]
    return cls


def lora_config_of(module: nn.Module):
    """The LoRA config injected into `module` in place, or None."""
    configs = getattr(module, "peft_config", None)
    return configs.get("default") if isinstance(configs, dict) else None


def base_state_dict(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A state dict with LoRA adapters removed and `base_layer` folded back: the original keys."""
    return {key.replace(".base_layer.", "."): value for key, value in state.items()
            if ".lora_" not in key and not key.startswith("lora_")}


def merged_state_dict(module: nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Base weights with every LoRA delta (B @ A x scaling) added in: a plain model's state dict."""
    merged = base_state_dict(state)
    for name, sub in module.named_modules():
        if isinstance(sub, lora_linear_class()) and "default" in sub.lora_A:
            a, b = state[f"{name}.lora_A.default.weight"], state[f"{name}.lora_B.default.weight"]
            delta = lora_linear_delta(sub, a, b)
            merged[f"{name}.weight"] = merged[f"{name}.weight"] + delta.to(merged[f"{name}.weight"].dtype)
        elif hasattr(sub, "lora_A") and "default" in getattr(sub, "lora_A", {}):
            raise NotImplementedError(f"merging LoRA into {type(sub).__name__} layers ({name}) is not supported")
    return merged


def record_original_class(folder: str, cls: type) -> None:
    """`save_pretrained` of a wrapped module records the wrapper subclass; record the module's own class."""
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


def save_module(module: nn.Module, folder: str, state: dict[str, torch.Tensor], processor: Any = None,
                merge_lora: bool = False, executor=None):
    """Write `module` to `folder` in HF format (LoRA: base weights + adapter files beside them), from its full
    `state` (`parallel.full_state_dict`, gathered on every rank; the main process calls this). With an
    `executor`, the tensors are copied now and written in the background: returns the future."""
    lora = lora_config_of(module)
    weights = merged_state_dict(module, state) if (lora and merge_lora) else base_state_dict(state)
    adapter = None
    if lora is not None and not merge_lora:
        from peft import get_peft_model_state_dict

        adapter = {PEFT_PREFIX + k: v for k, v in get_peft_model_state_dict(module, state_dict=state).items()}
    copy = executor is not None  # training goes on while the files are written: write a snapshot
    weights, adapter = (on_cpu(t, copy) if t is not None else None for t in (weights, adapter))
    write = lambda: write_module_files(module, folder, weights, lora, adapter, processor)  # noqa: E731
    return executor.submit(write) if executor is not None else write()


def on_cpu(tensors: dict[str, torch.Tensor], copy: bool) -> dict[str, torch.Tensor]:
    return {k: (v.detach().to("cpu", copy=copy)).contiguous() for k, v in tensors.items()}


def write_module_files(module, folder, weights, lora, adapter, processor) -> None:
    os.makedirs(folder, exist_ok=True)
    module.save_pretrained(folder, state_dict=weights)
    record_original_class(folder, original_class(module))
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
        adopt_loaded_adapter(module)
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


def build_empty(module_cls, folder: str) -> nn.Module:
    """The module of `folder` with parameters on the meta device and real buffers (`empty_init`; rotary tables
    and the like are computed, not loaded); a LoRA adapter beside the weights is injected, empty too."""
    from accelerate import init_empty_weights

    config = module_cls.config_class.from_pretrained(folder)
    with init_empty_weights(include_buffers=False):
        module = module_cls(config)
    if has_adapter(folder):
        from peft import LoraConfig, inject_adapter_in_model

        inject_adapter_in_model(LoraConfig.from_pretrained(folder), module)
    return module


def copy_module_folder(folder: str, out: str, skip: tuple[str, ...] = ()) -> None:
    """Copy a module's HF folder to `out`, leaving out the names in `skip` (a checkpoint's `state/`)."""
    import shutil

    shutil.copytree(folder, out, ignore=shutil.ignore_patterns(*skip))
