"""`FsdpSettings`: the keys of a module's `fsdp_plugin` entry, declared as the per-module keys are (`keys`), and the
module's Accelerate `FullyShardedDataParallelPlugin` built from them (`build_plugin`).

The plugin is built with the environment's `FSDP_*` variables hidden and the environment restored after (Accelerate
reads unset fields from them and writes `FSDP_CPU_RAM_EFFICIENT_LOADING`)."""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..compat import fsdp_ignored_params, no_split_modules
from ..core.errors import OmniArgumentError
from ..core.keys import check_field, declared, key
from ..core.refusals import TUNED, refusal

MIXED_PRECISION_NAMES = ("no", "bf16", "fp16")
MIXED_PRECISION_KEYS = ("param_dtype", "reduce_dtype", "output_dtype")
MIXED_PRECISION_DTYPES = ("bfloat16", "float16", "float32")


def check_mixed_precision(module: str | None, value: Any) -> None:
    if isinstance(value, str) and value not in MIXED_PRECISION_NAMES:
        raise OmniArgumentError(module, "fsdp_plugin.mixed_precision",
                                f"must be one of {MIXED_PRECISION_NAMES} or a dict, got {value!r}")
    if value == "fp16" or (isinstance(value, dict) and value.get("param_dtype") == "float16"):
        raise OmniArgumentError(module, "fsdp_plugin.mixed_precision", "fp16 needs the run's loss scaler: set "
                                "`fp16: true` for the run and leave this unset (the module then gathers in fp16), "
                                "or use bf16")
    if isinstance(value, dict):
        for name, dtype in value.items():
            if name not in MIXED_PRECISION_KEYS or dtype not in MIXED_PRECISION_DTYPES:
                raise OmniArgumentError(module, f"fsdp_plugin.mixed_precision.{name}",
                                        f"keys {MIXED_PRECISION_KEYS}, values {MIXED_PRECISION_DTYPES}; got {dtype!r}")


def _refuse_ram_loading(module: str | None, value: bool) -> None:
    if value:
        raise OmniArgumentError(module, "fsdp_plugin.cpu_ram_efficient_loading", "hf_omni does not load through "
                                "Accelerate: build the model with `from_pretrained(dir, empty_init=True)` instead")


@dataclass
class FsdpSettings:
    """A module's `fsdp_plugin` settings, from which hf_omni builds its Accelerate `FullyShardedDataParallelPlugin`."""

    transformer_cls_names_to_wrap: list | None = key(
        None, (list, str), "layer classes wrapped as FSDP units (default: the module's `_no_split_modules`)",
        nullable=True, top_level=None)
    min_num_params: int | None = key(
        None, (int,), "size-based wrapping instead (not with `transformer_cls_names_to_wrap`)", nullable=True,
        minimum=0, top_level=None)
    reshard_after_forward: bool = key(True, (bool,), "free gathered parameters after forward", top_level=None)
    reshard_after_backward: bool = key(
        True, (bool,), "false: stay gathered across a gradient-accumulation window", top_level=None)
    mixed_precision: str | dict | None = key(
        None, (str, dict), "`no`, `bf16`, or {param_dtype, reduce_dtype, output_dtype} as dtype names; unset: "
        "the run's bf16 or fp16; gradients are reduced in fp32 unless `reduce_dtype` says otherwise",
        nullable=True, check=check_mixed_precision, top_level=None)
    cpu_offload: bool = key(False, (bool,), "keep sharded parameters on CPU", top_level=None)
    cpu_ram_efficient_loading: bool = key(False, (bool,), "refused: build with `empty_init=True` (each rank reads "
                                          "only its own rows)", top_level=None, check=_refuse_ram_loading)
    ignored_modules: list | str | None = key(None, (list, str), "frozen submodules left unsharded (one that trains: "
                                             "refused)", nullable=True, top_level=None)

    @classmethod
    def check_overlay(cls, module: str | None, settings: dict) -> None:
        """Validate an `fsdp_plugin` dict as written (in an overlay, null removes an inherited setting)."""
        known = declared(cls)
        for name, value in settings.items():
            if name not in known:
                raise OmniArgumentError(module, f"fsdp_plugin.{name}", f"unknown key; known: {sorted(known)}")
            if value is not None:
                check_field(module, f"fsdp_plugin.{name}", value, dict(known[name].metadata))
        if settings.get("min_num_params") is not None and settings.get("transformer_cls_names_to_wrap"):
            raise OmniArgumentError(module, "fsdp_plugin.min_num_params",
                                    "size-based wrapping cannot be combined with transformer_cls_names_to_wrap")

    def param_dtype(self, run_dtype: torch.dtype | None) -> torch.dtype | None:
        """The dtype parameters are gathered and computed in: `mixed_precision`'s where set, else the run's."""
        setting = self.mixed_precision
        if setting == "no":
            return run_dtype
        if isinstance(setting, dict):
            param = setting.get("param_dtype")
            return getattr(torch, param) if param and param != "float32" else run_dtype
        return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(setting, run_dtype) if setting else run_dtype

    @classmethod
    def from_dict(cls, module: str | None, settings: dict) -> "FsdpSettings":
        cls.check_overlay(module, settings)
        out = cls(**{k: v for k, v in settings.items() if v is not None})
        if isinstance(out.transformer_cls_names_to_wrap, str):
            out.transformer_cls_names_to_wrap = [out.transformer_cls_names_to_wrap]
        return out


@contextlib.contextmanager
def isolated_fsdp_environment():
    """Hide `FSDP_*` variables while a plugin is built, and undo whatever it writes to the environment."""
    saved = {k: v for k, v in os.environ.items() if k.startswith("FSDP_")}
    for name in saved:
        del os.environ[name]
    try:
        yield
    finally:
        for name in [k for k in os.environ if k.startswith("FSDP_")]:
            del os.environ[name]
        os.environ.update(saved)


def mixed_precision_policy(value, compute: torch.dtype | None = None):
    """The module's FSDP2 `MixedPrecisionPolicy`: its `fsdp_plugin.mixed_precision` (`no`, `bf16`, or
    {param_dtype, reduce_dtype, output_dtype} as dtype names); unset: parameters gathered in the run's bf16 or fp16
    compute dtype (`compute`). Gradients are reduced in fp32 unless `reduce_dtype` says otherwise (a bf16 sum over
    hundreds of ranks loses the small contributions); FSDP2 casts the reduced gradient back to the shard's dtype, so
    under fp16 the shards and their gradients stay fp32 and the run's GradScaler unscales fp32 gradients. None: no
    policy (parameters as held, fp32 reductions of fp32 gradients)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if value == "no":
        return None
    if isinstance(value, dict):
        dtypes = {k: getattr(torch, v) for k, v in value.items()}
        dtypes.setdefault("reduce_dtype", torch.float32)
        return MixedPrecisionPolicy(**dtypes)
    half = compute if value is None and compute in (torch.bfloat16, torch.float16) else None
    param = torch.bfloat16 if value == "bf16" else half  # fp16: the shards and gradients stay fp32 (the scaler's)
    return MixedPrecisionPolicy(param_dtype=param, reduce_dtype=torch.float32)


def build_plugin(module: nn.Module, name: str, settings: FsdpSettings, compute: torch.dtype | None = None):
    """One fresh Accelerate plugin for this module (plugins are mutated by `set_auto_wrap_policy`)."""
    from accelerate.utils import FullyShardedDataParallelPlugin

    size_based = settings.min_num_params is not None
    kwargs = dict(
        fsdp_version=2,
        reshard_after_forward=settings.reshard_after_forward,
        cpu_offload=settings.cpu_offload,
        cpu_ram_efficient_loading=settings.cpu_ram_efficient_loading,
        mixed_precision_policy=mixed_precision_policy(settings.mixed_precision, compute),
        ignored_modules=settings.ignored_modules,
        activation_checkpointing=False,
        state_dict_type="SHARDED_STATE_DICT",
        auto_wrap_policy="size_based_wrap" if size_based else "transformer_based_wrap",
    )
    if size_based:
        kwargs["min_num_params"] = settings.min_num_params
    else:
        kwargs["transformer_cls_names_to_wrap"] = (settings.transformer_cls_names_to_wrap
                                                   or sorted(no_split_modules(module)))  # those present in it
    try:
        with isolated_fsdp_environment():
            return FullyShardedDataParallelPlugin(**kwargs)
    except (ValueError, TypeError) as err:
        raise OmniArgumentError(name, "fsdp_plugin", str(err)) from None


@refusal(TUNED)
def check_ignored_modules(model, args) -> None:
    """After freezing and LoRA, before any wrap or compute: FSDP leaves `fsdp_plugin.ignored_modules` unsharded and
    never reduces their gradients, so a submodule there with a parameter that trains would be stepped by each rank
    on its own gradient (the replicas diverge) and crash the first clip (plain tensors beside DTensors): refused,
    naming the module (none under `fsdp_scope: model`, whose one plugin is the top level's), the key and the
    parameters. Frozen submodules (a frozen tower's, a LoRA base's) may be ignored."""
    if args.fsdp_scope == "model":
        ignored = args.fsdp_plugin.get("ignored_modules") if isinstance(args.fsdp_plugin, dict) else None
        refuse_trained(None, model, ignored)
        return
    for name, slot in model.slots.items():
        if slot.args is not None and slot.args.parallel == "fsdp":
            refuse_trained(name, slot.module, getattr(slot.settings, "ignored_modules", None))


def refuse_trained(name: str | None, module, ignored) -> None:
    if ignored is None:
        return
    params = fsdp_ignored_params(ignored, module, None)
    trained = [n for n, p in module.named_parameters() if p.requires_grad and p in params]
    if trained:
        shown = f"'{ignored}'" if isinstance(ignored, str) else repr(ignored)
        raise OmniArgumentError(name, "fsdp_plugin.ignored_modules", f"{shown} holds parameters that train "
                                f"({', '.join(trained[:3])}{', ...' if len(trained) > 3 else ''}): FSDP never "
                                "reduces an ignored module's gradients, so each rank would step its own copy. "
                                "Freeze those submodules, or leave them out of ignored_modules")
