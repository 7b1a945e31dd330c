"""One module as a Hugging Face folder: write it (config, weights, processor, LoRA adapter), load it back (whole,
or on the meta device for `empty_init`), copy it.

A module wrapped in place (FSDP2 / composable replicate) has a generated subclass; the folder records
the module's original class so that `AutoModel*.from_pretrained(folder)` and `OmniModel` find it.
A LoRA module (adapters injected in place with PEFT) is written as its base weights plus
`adapter_config.json` + `adapter_model.safetensors`, as `PeftModel.save_pretrained` would write them.
"""

from __future__ import annotations

import functools
import json
import os
from typing import Any

from torch import nn

from ..core.dist import agreed, checkpoint_group, is_main
from ..lora.adapters import ADAPTER_CONFIG, has_adapter, load_adapter, lora_config_of
from ..lora.merge import row_merge_plan
from ..modules.ema import export_weights
from . import folder_write
from .empty_init import build_empty
from .folder_plan import plan_folder
from .format import folder_patterns, format_of
from .lora_base import weights_folder
from .peft_merge import check_peft_merge, merged_module, save_merged

PROCESSOR_KINDS = ("tokenizer", "processor", "image_processor", "feature_extractor")


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


def load_processor(folder: str, kind: str):
    from transformers import AutoFeatureExtractor, AutoImageProcessor, AutoProcessor, AutoTokenizer

    auto = {"tokenizer": AutoTokenizer, "processor": AutoProcessor, "image_processor": AutoImageProcessor,
            "feature_extractor": AutoFeatureExtractor}[kind]
    return auto.from_pretrained(folder)


# a module folder's files of any format (weights, adapter, processor, an adopted model's record): `module_patterns`
# adds each format's config files
MODULE_FILES = ("*.safetensors", "*.safetensors.index.json", "adapter_config.json", "tokenizer*",
                "special_tokens_map.json", "added_tokens.json", "vocab*", "merges.txt", "*.model", "chat_template*",
                "preprocessor_config.json", "*processor_config.json", "feature_extractor_config.json",
                "video_preprocessor_config.json", "hf_omni.json",
                "spk_dict.pt")  # Qwen2.5-Omni's speakers: its from_pretrained requires them (read weights_only)


def module_patterns() -> list[str]:
    """`MODULE_FILES` and every module format's config files (`ModuleFormat.config_files` / `other_files`)."""
    return list(dict.fromkeys([*MODULE_FILES, *folder_patterns()]))


def module_files(folder: str) -> list[str]:
    """The names of a module folder's HF files (`MODULE_FILES`, regular files, no links), sorted."""
    return sorted(module_paths(folder))


def module_paths(folder: str) -> dict[str, str]:
    """A module folder's HF files (`MODULE_FILES`, regular files, no links): name -> path. A LoRA checkpoint folder
    whose base was written apart (`lora_base`) gets the base's weight files too, as if they were beside it."""
    import fnmatch

    patterns = module_patterns()

    def listed(where: str) -> dict[str, str]:
        return {n: os.path.join(where, n) for n in os.listdir(where) if any(fnmatch.fnmatch(n, p) for p in patterns)
                and os.path.isfile(os.path.join(where, n)) and not os.path.islink(os.path.join(where, n))}

    base = weights_folder(folder)
    return {**(listed(base) if base != folder else {}), **listed(folder)}


def adapter_config_with_base(folder: str, base: str | None) -> bytes:
    """A module folder's adapter config naming `base` as its base model (None: the weights beside it)."""
    with open(os.path.join(folder, ADAPTER_CONFIG)) as f:
        return json.dumps({**json.load(f), "base_model_name_or_path": base}, indent=2, sort_keys=True).encode()


def copy_module_folder(folder: str, out: str) -> list[str]:
    """Copy a module's HF files (config, weights, adapter, processor — the names in `MODULE_FILES`, regular files
    only) from `folder` to `out`; nothing else of the folder (a checkpoint's `state/`, links, stray files). A LoRA
    base written apart is copied in, and the adapter config then names the weights beside it."""
    import shutil

    paths = module_paths(folder)
    os.makedirs(out, exist_ok=True)
    for name, path in paths.items():
        shutil.copy2(path, os.path.join(out, name))
    if weights_folder(folder) != folder:
        with open(os.path.join(out, ADAPTER_CONFIG), "wb") as f:
            f.write(adapter_config_with_base(folder, None))
    return sorted(paths)


def load_module(module_cls, folder: str, empty_init: bool, merge_lora: bool = False, **kwargs) -> nn.Module:
    """One module back from its folder: built on the meta device (`empty_init`: it is read once wrapped), or loaded
    by its format (a transformers class's `from_pretrained(folder, **kwargs)`) with a LoRA adapter beside the weights injected (merged into
    plain weights by PEFT with `merge_lora`)."""
    if empty_init:
        return build_empty(module_cls, folder)
    module = format_of(module_cls).load(module_cls, weights_folder(folder), **kwargs)  # a LoRA base apart: there
    if has_adapter(folder):
        load_adapter(module, folder)  # transformers may have loaded it already: then it is adopted
        if merge_lora:
            device = next(module.parameters()).device
            module = merged_module(module, dict(module.state_dict())).to(device)
    return module


def export_module(slot, folder: str, merge_lora: bool = False, is_main_process: bool = True,
                  max_shard_size: str | int = "50GB") -> None:
    """`slot`'s module as an HF folder. A module with sharded tensors: every rank calls this and writes its own
    rows in place (`merge_lora`: merged row by row, `lora.merge`; a LoRA that needs PEFT's own merge is gathered
    and merged on the main process); any other module: the main process writes it alone, as transformers'
    `save_pretrained` would. With `export_ema`, its EMA weights (swapped in for the write, then back)."""
    with export_weights(slot):
        _export_module(slot, folder, merge_lora, is_main_process, max_shard_size)


def _export_module(slot, folder: str, merge_lora: bool, is_main_process: bool, max_shard_size) -> None:
    lora = lora_config_of(slot.module) is not None
    merge = row_merge_plan(slot.module) if merge_lora and lora else None
    if merge_lora and lora and merge is None:
        check_peft_merge(slot.module, slot.name, slot.export_dtypes)
        state = slot.full_state()
        if is_main_process:
            save_merged(slot.module, folder, state, slot.processor, slot.export_dtype, max_shard_size)
        return
    plan = plan_folder(slot.module, slot.export_dtypes, max_shard_size, merged=merge is not None)
    write = functools.partial(folder_write.write_module_folder, slot.module, folder, plan, slot.processor,
                              dtypes=slot.export_dtypes, merge=merge)
    if not folder_write.has_shards(slot.module):
        if is_main_process:
            os.makedirs(folder, exist_ok=True)
            folder_write.remove_weight_files(folder)
            write(solo=True)
        return
    with agreed(f"module {slot.name!r}: preparing {folder}", checkpoint_group()):
        if is_main():
            os.makedirs(folder, exist_ok=True)
            folder_write.remove_weight_files(folder)
    with agreed(f"module {slot.name!r}: writing {folder}", checkpoint_group()):  # every rank its own rows
        write()


def write_frozen_source(slot, output_dir: str | None, group) -> None:
    """A fully frozen module with no source (built in memory) is written once to <output_dir>/frozen/<module>/,
    which becomes its recorded source (every rank calls this and writes its part)."""
    if slot.entry.source:
        return
    if not output_dir:
        raise ValueError(f"module {slot.name!r} is frozen and was built in memory: saving it needs an output_dir "
                         "(args.output_dir, or OmniPlugin(output_dir=...))")
    folder = os.path.abspath(os.path.join(output_dir, "frozen", slot.name))
    with agreed(f"module {slot.name!r}: preparing {folder}", group):
        if is_main():
            os.makedirs(folder, exist_ok=True)
            folder_write.remove_weight_files(folder)
    with agreed(f"module {slot.name!r}: writing {folder}", group):  # every rank its own rows
        folder_write.write_module_folder(slot.module, folder, plan_folder(slot.module), slot.processor)
    slot.record_source(folder)
