"""`FsdpSettings`: the keys of a module's `fsdp_plugin` entry, declared as the per-module keys are (`keys`),
from which `parallel.fsdp` builds the module's Accelerate `FullyShardedDataParallelPlugin`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..errors import OmniArgumentError
from ..keys import check_field, declared, key

MIXED_PRECISION_NAMES = ("no", "bf16", "fp16")
MIXED_PRECISION_KEYS = ("param_dtype", "reduce_dtype", "output_dtype")
MIXED_PRECISION_DTYPES = ("bfloat16", "float16", "float32")


def check_mixed_precision(module: str | None, value: Any) -> None:
    if isinstance(value, str) and value not in MIXED_PRECISION_NAMES:
        raise OmniArgumentError(module, "fsdp_plugin.mixed_precision",
                                f"must be one of {MIXED_PRECISION_NAMES} or a dict, got {value!r}")
    if value == "fp16" or (isinstance(value, dict) and value.get("param_dtype") == "float16"):
        raise OmniArgumentError(module, "fsdp_plugin.mixed_precision", "fp16 parameters need loss scaling, which "
                                "per-module FSDP does not do: use bf16")
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
        "the run's bf16; gradients are reduced in fp32 unless `reduce_dtype` says otherwise",
        nullable=True, check=check_mixed_precision, top_level=None)
    cpu_offload: bool = key(False, (bool,), "keep sharded parameters on CPU", top_level=None)
    cpu_ram_efficient_loading: bool = key(False, (bool,), "refused: build with `empty_init=True` (each rank reads "
                                          "only its own rows)", top_level=None, check=_refuse_ram_loading)
    ignored_modules: list | str | None = key(None, (list, str), "submodules left unsharded", nullable=True,
                                             top_level=None)

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

    @classmethod
    def from_dict(cls, module: str | None, settings: dict) -> "FsdpSettings":
        cls.check_overlay(module, settings)
        out = cls(**{k: v for k, v in settings.items() if v is not None})
        if isinstance(out.transformer_cls_names_to_wrap, str):
            out.transformer_cls_names_to_wrap = [out.transformer_cls_names_to_wrap]
        return out
