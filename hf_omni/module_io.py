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

from .compat import adopt_loaded_adapter
from .module_classes import original_class, save_view  # noqa: F401 (original_class re-exported)

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."
PROCESSOR_KINDS = ("tokenizer", "processor", "image_processor", "feature_extractor")


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


def merged_module(module: nn.Module, state: dict[str, torch.Tensor]) -> nn.Module:
    """A plain copy of a LoRA module with every adapter merged by PEFT itself (`merge_and_unload`: LoRA on Linear,
    Embedding and Conv layers, DoRA, rsLoRA, `modules_to_save`), built from its full `state` on CPU."""
    import copy

    from accelerate import init_empty_weights
    from peft import get_peft_model, get_peft_model_state_dict, set_peft_model_state_dict

    with init_empty_weights(include_buffers=False):
        plain = original_class(module)(copy.deepcopy(module.config))
    # copies: the merge writes into the base weights, which must not be the live module's
    plain.load_state_dict({k: v.detach().to("cpu", copy=True) for k, v in base_state_dict(state).items()},
                          assign=True)
    plain.tie_weights()  # each name was assigned its own copy: tied weights one again, so the merge reaches all
    peft_model = get_peft_model(plain, copy.deepcopy(lora_config_of(module)))
    adapter = get_peft_model_state_dict(module, state_dict=state)
    result = set_peft_model_state_dict(peft_model, {PEFT_PREFIX + k: v for k, v in adapter.items()})
    if result.unexpected_keys:
        raise ValueError(f"merging LoRA: PEFT did not take {result.unexpected_keys[:5]}")
    untie_adapted_halves(peft_model)
    return peft_model.merge_and_unload()


def untie_adapted_halves(peft_model: nn.Module) -> None:
    """A tied weight with an adapter on one of its holders only (LoRA on the input embeddings, the tied output
    layer without one): training changed one side alone, so a merge into the one tensor would change the other
    side too. Those holders get their own copy before the merge, and the export's config stops tying them."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    adapted = {id(layer.get_base_layer()) for layer in peft_model.modules() if isinstance(layer, BaseTunerLayer)}
    holders: dict[int, list[tuple[nn.Module, str]]] = {}
    for sub in peft_model.modules():
        for attr, param in sub._parameters.items():
            if param is not None:
                holders.setdefault(id(param), []).append((sub, attr))
    for group in holders.values():
        touched = [id(sub) in adapted for sub, _ in group]
        if len(group) > 1 and any(touched) and not all(touched):
            for (sub, attr), is_adapted in zip(group, touched):
                if not is_adapted:
                    param = sub._parameters[attr]
                    sub._parameters[attr] = nn.Parameter(param.detach().clone(), requires_grad=param.requires_grad)
            peft_model.get_base_model().config.tie_word_embeddings = False


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
                merge_lora: bool = False, pipeline=None) -> None:
    """Write `module` to `folder` in HF format (LoRA: base weights + adapter files beside them), from its full
    `state` (`parallel.full_state_dict`, gathered on every rank; the main process calls this). With a `pipeline`
    (`save_pipeline.SavePipeline`, async saves), the tensors are snapshotted and the files written in its thread."""
    lora = lora_config_of(module)
    if lora is not None and merge_lora:
        module, lora = merged_module(module, state), None
        weights = module.state_dict()
    else:
        weights = base_state_dict(state)
    adapter = adapter_state_dict(module, state) if lora is not None else None
    if pipeline is None:
        weights, adapter = (on_cpu(t) if t is not None else None for t in (weights, adapter))
        return write_module_files(module, folder, weights, lora, adapter, processor)
    weights, adapter = (pipeline.snapshot(t) if t is not None else (lambda: None) for t in (weights, adapter))
    pipeline.then(lambda: write_module_files(module, folder, weights(), lora, adapter(), processor),
                  f"writing {folder}")


def on_cpu(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}


def write_module_files(module, folder, weights, lora, adapter, processor) -> None:
    os.makedirs(folder, exist_ok=True)
    save_view(module).save_pretrained(folder, state_dict=weights)
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


def load_processor(folder: str, kind: str):
    from transformers import AutoFeatureExtractor, AutoImageProcessor, AutoProcessor, AutoTokenizer

    auto = {"tokenizer": AutoTokenizer, "processor": AutoProcessor, "image_processor": AutoImageProcessor,
            "feature_extractor": AutoFeatureExtractor}[kind]
    return auto.from_pretrained(folder)


MODULE_FILES = ("config.json", "generation_config.json", "*.safetensors", "*.safetensors.index.json",
                "adapter_config.json", "tokenizer*", "special_tokens_map.json", "added_tokens.json", "vocab*",
                "merges.txt", "*.model", "chat_template*", "preprocessor_config.json", "*processor_config.json",
                "feature_extractor_config.json", "video_preprocessor_config.json")


def module_files(folder: str) -> list[str]:
    """The names of a module folder's HF files (`MODULE_FILES`, regular files, no links), sorted."""
    import fnmatch

    return sorted(n for n in os.listdir(folder) if any(fnmatch.fnmatch(n, p) for p in MODULE_FILES)
                  and os.path.isfile(os.path.join(folder, n)) and not os.path.islink(os.path.join(folder, n)))


def copy_module_folder(folder: str, out: str) -> list[str]:
    """Copy a module's HF files (config, weights, adapter, processor — the names in `MODULE_FILES`, regular files
    only) from `folder` to `out`; nothing else of the folder (a checkpoint's `state/`, links, stray files)."""
    import shutil

    names = module_files(folder)
    os.makedirs(out, exist_ok=True)
    for name in names:
        shutil.copy2(os.path.join(folder, name), os.path.join(out, name))
    return names
