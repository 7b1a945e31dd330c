"""The diffusers format: a diffusers `ModelMixin` (`UNet2DConditionModel`, `SD3Transformer2DModel`,
`FluxTransformer2DModel`, `AutoencoderKL`, ...) in the folder its `save_pretrained` writes: `config.json` (with
`_class_name`, the module's own class, never a wrapper's) and `diffusion_pytorch_model.safetensors`, or shards with
`diffusion_pytorch_model.safetensors.index.json`. Its state dict is written as it is (diffusers has no save-time key
conversion). diffusers is an optional extra (`pip install 'hf_omni[diffusion]'`): without it nothing here imports
it, and a module or a saved record of a diffusers class is refused naming the extra."""

from __future__ import annotations

import contextlib
import functools
import importlib
import json
import os

import torch
from torch import nn

from ..compat import supports_block_checkpointing
from ..files.format import ModuleFormat, original_class, register_module_format

RECORD_PREFIX = "diffusers."  # the root config records "diffusers.UNet2DConditionModel"
EXTRA = "diffusers is not installed: pip install 'hf_omni[diffusion]'"
SAVED_BY = ("_name_or_path", "_diffusers_version", "_use_default_values", "_ignore_files")


def diffusers_module(submodule: str = "", needed_by: str = "a diffusers module"):
    """`import diffusers` (or a submodule of it), or an error naming the extra and what needed it."""
    try:
        return importlib.import_module("diffusers" + (f".{submodule}" if submodule else ""))
    except ImportError:
        raise ImportError(f"{EXTRA} ({needed_by} needs it)") from None


def from_diffusers(cls: type) -> bool:
    """Whether a class of diffusers is among `cls`'s bases (no import: a class of diffusers means it is loaded)."""
    return any(c.__module__.split(".")[0] == "diffusers" for c in cls.__mro__)


@register_module_format
class DiffusersFormat(ModuleFormat):
    name = "diffusers"
    description = "a diffusers `ModelMixin` in the folder its `save_pretrained` writes"
    config_files = ("config.json",)
    weights_pattern = "diffusion_pytorch_model{suffix}.safetensors"
    weights_index = "diffusion_pytorch_model.safetensors.index.json"
    library_name = "diffusers"

    def handles(self, cls: type) -> bool:
        if not from_diffusers(cls):
            return False
        return issubclass(cls, diffusers_module("models.modeling_utils").ModelMixin)

    def is_folder(self, folder: str) -> bool:
        return any(os.path.isfile(os.path.join(folder, n)) for n in (self.weights_file, self.weights_index))

    def class_record(self, cls: type, module: str) -> str:
        if getattr(diffusers_module(), cls.__name__, None) is not cls:
            raise ValueError(f"module {module!r}: {cls.__module__}.{cls.__name__} is not a class diffusers exports, "
                             "so a saved composition could not find it again")
        return RECORD_PREFIX + cls.__name__

    def resolve(self, record: str) -> type | None:
        if not record.startswith(RECORD_PREFIX):
            return None
        found = getattr(diffusers_module(needed_by=f"class {record!r}"), record[len(RECORD_PREFIX):], None)
        if not (isinstance(found, type) and self.handles(found)):
            raise ValueError(f"class {record!r} is not a diffusers model class (diffusers "
                             f"{diffusers_module().__version__})")
        return found

    def load(self, cls: type, folder: str, dtype=None, device_map=None) -> nn.Module:
        module = cls.from_pretrained(folder, torch_dtype=dtype)
        return module.to(device_map) if device_map is not None else module

    def build_empty(self, cls: type, folder: str, name_or_path: str) -> nn.Module:
        """What `ModelMixin.from_pretrained` does before it reads the weights (docs/from_pretrained.md): the config
        through `load_config` / `from_config`, built under diffusers' `no_init_weights` and Accelerate's
        `init_empty_weights` (parameters on meta, buffers computed) in the default dtype (diffusers loads in float32
        unless a dtype is asked: its `_keep_in_fp32_modules` apply only then), `_name_or_path` registered, eval."""
        from accelerate import init_empty_weights

        no_init = diffusers_module("models.modeling_utils").no_init_weights
        config = cls.load_config(folder)
        with contextlib.ExitStack() as stack:
            stack.enter_context(no_init())
            stack.enter_context(init_empty_weights(include_buffers=False))
            module = cls.from_config(config)
        module.register_to_config(_name_or_path=name_or_path)
        return module.eval()

    def empty_copy(self, module: nn.Module) -> nn.Module:
        from accelerate import init_empty_weights

        with init_empty_weights(include_buffers=False):
            return original_class(module).from_config(module.config)

    def write_config(self, module: nn.Module, folder: str, dtype=None) -> None:
        """`config.json` as `save_config` writes it, naming the module's own class (not an in-place wrapper's)."""
        values = json.loads(module.to_json_string())
        values["_class_name"] = original_class(module).__name__
        values.pop("_name_or_path", None)
        with open(os.path.join(folder, self.config_files[0]), "w") as f:
            f.write(json.dumps(values, indent=2, sort_keys=True) + "\n")

    def source_path(self, module: nn.Module) -> str:
        return str(module.config.get("_name_or_path", "") or "")

    def describe(self, module: nn.Module) -> dict:
        return {k: v for k, v in json.loads(module.to_json_string()).items() if k not in SAVED_BY}

    def checkpointed_models(self, module: nn.Module) -> list[tuple[nn.Module, list[nn.Module]]]:
        return [(module, [])] if supports_block_checkpointing(module) else []

    def enable_checkpointing(self, model: nn.Module, kwargs: dict, every_n_layers: int, offload: bool) -> None:
        """diffusers' `enable_gradient_checkpointing`, with torch's checkpoint given the module's kwargs."""
        if every_n_layers != 1 or offload:
            raise ValueError("diffusers checkpoints every block: every_n_layers and offload are not supported")
        checkpoint = functools.partial(torch.utils.checkpoint.checkpoint, **kwargs)
        model.enable_gradient_checkpointing(lambda block, *args: checkpoint(block.__call__, *args))

    def card_usage(self, record: str, repo_id: str, subfolder: str | None) -> list[str]:
        name = record[len(RECORD_PREFIX):]
        where = f'"{repo_id}"' + (f', subfolder="{subfolder}"' if subfolder else "")
        return ["This module alone:", "", "```python", f"from diffusers import {name}", "",
                f"model = {name}.from_pretrained({where})", "```", ""]

    def rebuild_difference(self, cls: type, folder: str, origin: str) -> str | None:
        ours, theirs = ({k: v for k, v in cls.load_config(f).items() if k not in SAVED_BY} for f in (folder, origin))
        if ours != theirs:
            return "config: " + ", ".join(sorted(k for k in set(ours) | set(theirs) if ours.get(k) != theirs.get(k)))
        return None
