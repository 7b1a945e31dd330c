"""Memory-efficient builds: modules created on the meta device, filled from their weights folder in `prepare`.

`OmniModel.from_pretrained(dir, empty_init=True)` builds each module's parameters on the meta device (buffers
stay real: rotary tables and the like are computed, not loaded) and records the folder its weights live in.
`OmniPlugin.prepare` then fills each module where it ends up:

- a module that will be sharded is sharded first (on meta), then every rank allocates its own shards and reads
  just those rows from the safetensors files (`get_slice`): no rank ever holds a full copy, no communication;
- any other module is allocated whole and read tensor by tensor.

LoRA adapters injected in place (from the folder's adapter files, or new) are filled the same way; parameters
the files lack (a head the module never saved, a fresh adapter) get the module's own initialisation.
"""

from __future__ import annotations

import json
import logging
import os

import torch
from torch import nn

from .compat import init_weights, saved_key_names
from .module_io import ADAPTER_WEIGHTS, PEFT_PREFIX, has_adapter

logger = logging.getLogger(__name__)


def is_empty(module: nn.Module) -> bool:
    return any(p.is_meta for p in module.parameters())


class SafetensorsIndex:
    """Key -> file of a folder's safetensors weights (one file or shards + index), opened lazily."""

    def __init__(self, folder: str, filenames: list[str]):
        from safetensors import safe_open

        self.handles = {}
        self.where = {}
        for name in filenames:
            path = os.path.join(folder, name)
            if os.path.isfile(path):
                handle = self.handles[name] = safe_open(path, framework="pt")
                for key in handle.keys():
                    self.where[key] = handle

    @classmethod
    def for_weights(cls, folder: str) -> "SafetensorsIndex":
        index = os.path.join(folder, "model.safetensors.index.json")
        if os.path.isfile(index):
            with open(index) as f:
                return cls(folder, sorted(set(json.load(f)["weight_map"].values())))
        return cls(folder, ["model.safetensors"])

    def __contains__(self, key: str) -> bool:
        return key in self.where

    def read(self, key: str, rows: tuple[int, int] | None = None) -> torch.Tensor:
        """The whole tensor, or only rows [start, stop) of dim 0 (read from disk alone)."""
        if rows is None:
            return self.where[key].get_tensor(key)
        return self.where[key].get_slice(key)[rows[0]:rows[1]]


def _file_keys(state_key: str, keymap: dict[str, str]) -> tuple[list[str], bool]:
    """Where a parameter of a (possibly LoRA-injected) module may live: (candidate file keys, is an adapter)."""
    if ".lora_" in state_key:
        return [PEFT_PREFIX + state_key.replace(".default.", ".")], True
    native = state_key.replace(".base_layer.", ".")
    return [k for k in (keymap.get(native), native) if k], False


def _local_rows(param) -> tuple[int, int] | None:
    """Rows [start, stop) of dim 0 this rank holds of a DTensor sharded on dim 0 (torch.chunk layout); None for a
    plain tensor."""
    if not hasattr(param, "to_local"):
        return None
    from torch.distributed.tensor import Shard

    (placement,) = param.placements
    if not isinstance(placement, Shard) or placement.dim != 0:
        raise NotImplementedError(f"empty_init loads dim-0 shards only, got {param.placements}")
    mesh = param.device_mesh
    rank, world = mesh.get_local_rank(), mesh.size()
    full = param.shape[0]
    chunk = -(-full // world)
    start = min(rank * chunk, full)
    return start, min(start + chunk, full)


@torch.no_grad()
def fill_module(module: nn.Module, folder: str, device: torch.device) -> list[str]:
    """Allocate `module`'s meta parameters on `device` (only the local shards of sharded ones) and read them
    from `folder`; returns the parameter names the files lack (initialised by the module instead)."""
    buffers = {name: buf.detach().clone() for name, buf in module.named_buffers()}
    module.to_empty(device=device)
    for name, buf in module.named_buffers():
        buf.copy_(buffers[name])
    missing = read_into(module, folder)
    if missing:
        logger.warning("hf_omni: %s has no stored value for %s; initialised by %s", folder, missing,
                       type(module).__name__)
        _initialise(module, missing)
    return missing


@torch.no_grad()
def read_into(module: nn.Module, folder: str, strict: bool = False, module_name: str = "",
              dry_run: bool = False) -> list[str]:
    """Copy the weights in `folder` (HF files, LoRA adapter beside them) into `module`'s parameters: a sharded
    parameter reads only this rank's rows. Shapes and dtypes must match (the error names module and parameter);
    returns the parameters the files lack (`strict`: an error)."""
    weights = SafetensorsIndex.for_weights(folder)
    adapter = SafetensorsIndex(folder, [ADAPTER_WEIGHTS]) if has_adapter(folder) else None
    plan, missing = [], []
    keymap = saved_key_names(module)
    for name, param in module.named_parameters():
        keys, is_adapter = _file_keys(name, keymap)
        source = adapter if is_adapter else weights
        key = next((k for k in keys if source is not None and k in source), None)
        if key is None:
            missing.append(name)
            continue
        handle = source.where[key].get_slice(key)
        shape, dtype = tuple(handle.get_shape()), handle.get_dtype()
        if shape != tuple(param.shape) or _DTYPES.get(dtype) != param.dtype:
            raise ValueError(f"module {module_name!r}: parameter {name} is {tuple(param.shape)} {param.dtype} in "
                             f"the model but {shape} {dtype} in {folder}")
        plan.append((name, param, source, key))
    if strict and missing:
        raise ValueError(f"module {module_name!r}: {folder} lacks parameters {missing[:5]}")
    if dry_run:
        return missing
    for name, param, source, key in plan:  # only after every check passed: nothing is half-overwritten
        rows = _local_rows(param)
        local = param.to_local() if rows is not None else param
        local.copy_(source.read(key, rows).to(local.dtype))
    return missing


_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64,
           "I64": torch.int64, "I32": torch.int32, "U8": torch.uint8, "BOOL": torch.bool}


def _initialise(module: nn.Module, names: list[str]) -> None:
    """The module's own initialisation for parameters with no stored value (LoRA layers: their reset)."""
    owners = {name.rsplit(".", 1)[0] if "." in name else "" for name in names}
    for owner in sorted(owners):
        sub = module.get_submodule(owner)
        if ".lora_" in f".{owner}.":
            layer = module.get_submodule(owner.split(".lora_")[0])
            layer.reset_lora_parameters("default", True)
        elif hasattr(module, "_init_weights"):
            init_weights(module, sub)
        else:
            raise ValueError(f"no stored value and no initialisation for {owner}")
