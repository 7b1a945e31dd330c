"""FSDP2 per module: one Accelerate `FullyShardedDataParallelPlugin(fsdp_version=2)` per module, applied by
hf_omni itself with `fully_shard` (Accelerate only shards its one global model, and never on CPU).

- The plugin is built with the environment's `FSDP_*` variables hidden and the environment restored after
  (Accelerate reads unset fields from them and writes `FSDP_CPU_RAM_EFFICIENT_LOADING`).
- Wrap units: the plugin's auto-wrap policy (Accelerate's helper), the input embeddings as their own unit
  (the composed forward calls them before the module's own forward), then the module root.
- Each module root is lazily initialised right away, so a unit called before the root (the embeddings)
  does not claim to be a root itself; methods other than `forward` that the composed forward calls
  (`generate`, `get_image_features`, ...) run through FSDP's hooks via `register_fsdp_forward_method`.
"""

from __future__ import annotations

import contextlib
import os

import torch
from torch import nn

from .arguments import ModuleArguments, OmniArgumentError
from .export import is_sharded

FORWARD_METHODS = ("generate", "get_image_features", "get_audio_features", "get_text_features",
                   "get_video_features", "encode", "decode")
_OWN_KEYS = ("reshard_after_backward",)  # applied by hf_omni, not Accelerate plugin fields


@contextlib.contextmanager
def isolated_fsdp_environment():
    """Hide `FSDP_*` variables while a plugin is built, and undo whatever it writes to the environment."""
    saved = {k: v for k, v in os.environ.items() if k.startswith("FSDP_")}
    for key in saved:
        del os.environ[key]
    try:
        yield
    finally:
        for key in [k for k in os.environ if k.startswith("FSDP_")]:
            del os.environ[key]
        os.environ.update(saved)


def _mixed_precision(value):
    """`no` | `bf16` | `fp16` (Accelerate's names) or {param_dtype, reduce_dtype, output_dtype} as dtype names."""
    if value is None or value == "no":
        return None
    if isinstance(value, dict):
        from torch.distributed.fsdp import MixedPrecisionPolicy

        return MixedPrecisionPolicy(**{k: getattr(torch, v) for k, v in value.items()})
    return value


def no_split_modules(module: nn.Module) -> set[str]:
    """Layer classes to wrap by default: the `_no_split_modules` of the module (of every module, for a composed
    model), kept to those present in it."""
    from transformers import PreTrainedModel

    present = {type(m).__name__ for m in module.modules()}
    names = set()
    for sub in module.modules():
        if isinstance(sub, PreTrainedModel):
            names.update(getattr(sub, "_no_split_modules", None) or [])
    return names & present


def build_fsdp_plugin(module: nn.Module, margs: ModuleArguments):
    """One fresh Accelerate plugin for this module (plugins are mutated by `set_auto_wrap_policy`)."""
    from accelerate.utils import FullyShardedDataParallelPlugin

    settings = {k: v for k, v in (margs.fsdp_plugin or {}).items() if k not in _OWN_KEYS}
    size_based = "min_num_params" in settings
    wrap_names = settings.pop("transformer_cls_names_to_wrap", None)
    if not size_based and wrap_names is None:
        wrap_names = sorted(no_split_modules(module))
    if isinstance(wrap_names, str):
        wrap_names = [wrap_names]
    kwargs = dict(
        fsdp_version=2,
        reshard_after_forward=settings.pop("reshard_after_forward", True),
        cpu_offload=settings.pop("cpu_offload", False),
        cpu_ram_efficient_loading=settings.pop("cpu_ram_efficient_loading", False),
        mixed_precision_policy=_mixed_precision(settings.pop("mixed_precision", None)),
        ignored_modules=settings.pop("ignored_modules", None),
        activation_checkpointing=False,
        state_dict_type="SHARDED_STATE_DICT",
        auto_wrap_policy="size_based_wrap" if size_based else "transformer_based_wrap",
    )
    if size_based:
        kwargs["min_num_params"] = settings.pop("min_num_params")
    else:
        kwargs["transformer_cls_names_to_wrap"] = wrap_names
    if settings:
        raise OmniArgumentError(margs.name, f"fsdp_plugin.{next(iter(settings))}", "unknown key")
    try:
        with isolated_fsdp_environment():
            plugin = FullyShardedDataParallelPlugin(**kwargs)
    except (ValueError, TypeError) as err:
        raise OmniArgumentError(margs.name, "fsdp_plugin", str(err)) from None
    plugin.reshard_after_backward = (margs.fsdp_plugin or {}).get("reshard_after_backward", True)
    return plugin


def _embeddings(module: nn.Module):
    """(input, output) embeddings where the module defines them (a composed model does not)."""
    found = []
    for getter in ("get_input_embeddings", "get_output_embeddings"):
        try:
            found.append(getattr(module, getter)())
        except (AttributeError, NotImplementedError):
            found.append(None)
    return found


def shard_module(module: nn.Module, plugin, device: torch.device, lazy_init: bool = True) -> nn.Module:
    """Apply `plugin` to `module` in place with `fully_shard` over all ranks. `lazy_init=False` for a module on the
    meta device: call `lazy_init_root` once its shards are filled."""
    import torch.distributed as dist
    from accelerate.utils.fsdp_utils import fsdp2_prepare_auto_wrap_policy, get_module_children_bottom_up
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard
    from torch.distributed.fsdp import register_fsdp_forward_method

    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    kwargs = dict(mesh=mesh, reshard_after_forward=plugin.reshard_after_forward,
                  offload_policy=plugin.cpu_offload or OffloadPolicy(),
                  mp_policy=plugin.mixed_precision_policy or MixedPrecisionPolicy())
    if plugin.ignored_modules is not None:
        from accelerate.utils.fsdp_utils import get_parameters_from_modules

        kwargs["ignored_params"] = get_parameters_from_modules(plugin.ignored_modules, module, device)
    try:
        policy = fsdp2_prepare_auto_wrap_policy(plugin, module)
    except ValueError as err:
        raise OmniArgumentError(None, "fsdp_plugin.transformer_cls_names_to_wrap", str(err)) from None
    if policy is not None:
        for sub in get_module_children_bottom_up(module)[:-1]:
            if policy(sub) and not isinstance(sub, FSDPModule):
                fully_shard(sub, **kwargs)
    embed, out_embed = _embeddings(module)
    tied = embed is not None and out_embed is not None and embed.weight is out_embed.weight
    if embed is not None and not is_sharded(embed):  # not inside a unit already (ViTEmbeddings)
        fully_shard([embed, out_embed] if tied else embed, **kwargs)  # tied weights: one unit for both
    fully_shard(module, **kwargs)
    if lazy_init:
        lazy_init_root(module)
    for name in FORWARD_METHODS:
        if callable(getattr(module, name, None)):
            register_fsdp_forward_method(module, name)
    return module


def lazy_init_root(module: nn.Module) -> None:
    """Initialise the module's FSDP state from its root now, so that a unit called before the root (the input
    embeddings, from the composed forward) does not claim to be a root itself."""
    module._get_fsdp_state()._lazy_init()
