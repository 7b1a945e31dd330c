"""`OmniTrainingArguments`: TrainingArguments plus a `modules:` section of per-module overlays.

Top-level values are every module's defaults; `modules.<name>` overlays them (dicts merge key by key,
lists and scalars replace, `null` removes the inherited value). Parsed with `HfArgumentParser` from YAML,
JSON or the CLI (`--modules` takes a JSON string). Every error is a `ValueError` naming the module and key,
raised at parse time when the arguments alone show it, else when the model is first seen (`OmniPlugin.prepare`).
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from typing import Any

from transformers import SchedulerType, TrainingArguments
from transformers.training_args import OptimizerNames

PARALLEL_CHOICES = ("fsdp", "ddp", "none")
FSDP_SCOPES = ("module", "model")
GRAD_CLIP_SCOPES = ("per_module", "global")
FSDP_PLUGIN_KEYS = {
    "transformer_cls_names_to_wrap": (list, str),
    "min_num_params": (int,),
    "reshard_after_forward": (bool,),
    "reshard_after_backward": (bool,),
    "mixed_precision": (str, dict),
    "cpu_offload": (bool,),
    "cpu_ram_efficient_loading": (bool,),
    "ignored_modules": (list, str),
}
MIXED_PRECISION_NAMES = ("no", "bf16", "fp16")
MIXED_PRECISION_KEYS = ("param_dtype", "reduce_dtype", "output_dtype")
MIXED_PRECISION_DTYPES = ("bfloat16", "float16", "float32")
_NUMBER = (int, float)
# per-module key -> accepted types (None allowed where listed)
MODULE_KEYS: dict[str, tuple] = {
    "trainable": (bool,),
    "lora": (dict, type(None)),
    "learning_rate": _NUMBER,
    "weight_decay": _NUMBER,
    "optim": (str,),
    "optim_args": (str, type(None)),
    "lr_scheduler_type": (str,),
    "lr_scheduler_kwargs": (dict, type(None)),
    "warmup_steps": _NUMBER,
    "max_grad_norm": _NUMBER + (type(None),),
    "activation_checkpointing": (bool,),
    "parallel": (str,),
    "fsdp_plugin": (dict, type(None)),
}
DICT_KEYS = ("lora", "lr_scheduler_kwargs", "fsdp_plugin")


class OmniArgumentError(ValueError):
    """A bad argument: the message names the module (or `top level`) and the key."""

    def __init__(self, module: str | None, key: str, message: str):
        self.module, self.key = module, key
        where = f"modules.{module}.{key}" if module else key
        super().__init__(f"{where}: {message}")


def merge_overlay(base: Any, overlay: Any) -> Any:
    """Dicts merge key by key (recursively); lists and scalars replace; `None` removes the inherited value."""
    if isinstance(base, dict) and isinstance(overlay, dict):
        out = dict(base)
        for key, value in overlay.items():
            if value is None:
                out.pop(key, None)
            else:
                out[key] = merge_overlay(base.get(key), value)
        return out
    return overlay


def _as_number(module: str | None, key: str, value: Any) -> Any:
    """YAML reads `1e-4` as a string: accept numeric strings for numeric keys."""
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            raise OmniArgumentError(module, key, f"expected a number, got {value!r}") from None
    return value


def _check_type(module: str | None, key: str, value: Any, types: tuple) -> None:
    if isinstance(value, bool) and bool not in types:
        raise OmniArgumentError(module, key, f"expected {'/'.join(t.__name__ for t in types)}, got bool {value!r}")
    if not isinstance(value, types):
        names = "/".join("null" if t is type(None) else t.__name__ for t in types)
        raise OmniArgumentError(module, key, f"expected {names}, got {type(value).__name__} {value!r}")


def check_fsdp_plugin(module: str | None, settings: dict) -> None:
    for key, value in settings.items():
        if key not in FSDP_PLUGIN_KEYS:
            raise OmniArgumentError(module, f"fsdp_plugin.{key}",
                                    f"unknown key; known: {sorted(FSDP_PLUGIN_KEYS)}")
        if value is None:  # in an overlay: removes the inherited setting
            continue
        _check_type(module, f"fsdp_plugin.{key}", value, FSDP_PLUGIN_KEYS[key])
    precision = settings.get("mixed_precision")
    if isinstance(precision, str) and precision not in MIXED_PRECISION_NAMES:
        raise OmniArgumentError(module, "fsdp_plugin.mixed_precision",
                                f"must be one of {MIXED_PRECISION_NAMES} or a dict, got {precision!r}")
    if isinstance(precision, dict):
        for key, dtype in precision.items():
            if key not in MIXED_PRECISION_KEYS or dtype not in MIXED_PRECISION_DTYPES:
                raise OmniArgumentError(module, f"fsdp_plugin.mixed_precision.{key}",
                                        f"keys {MIXED_PRECISION_KEYS}, values {MIXED_PRECISION_DTYPES}; got {dtype!r}")
    if "min_num_params" in settings and settings.get("transformer_cls_names_to_wrap"):
        raise OmniArgumentError(module, "fsdp_plugin.min_num_params",
                                "size-based wrapping cannot be combined with transformer_cls_names_to_wrap")


def check_lora(module: str | None, lora: dict) -> None:
    from peft import LoraConfig

    try:
        LoraConfig(**lora)
    except (TypeError, ValueError) as err:
        raise OmniArgumentError(module, "lora", f"not a valid peft.LoraConfig: {err}") from None


def check_value(module: str | None, key: str, value: Any) -> Any:
    """Validate (and coerce numeric strings of) one per-module key; returns the value to use."""
    types = MODULE_KEYS[key]
    if types is _NUMBER or _NUMBER[0] in types:
        value = _as_number(module, key, value)
    _check_type(module, key, value, types)
    if key in ("learning_rate", "weight_decay", "warmup_steps", "max_grad_norm") and value is not None and value < 0:
        raise OmniArgumentError(module, key, f"must be >= 0, got {value}")
    if key == "parallel" and value not in PARALLEL_CHOICES:
        raise OmniArgumentError(module, key, f"must be one of {PARALLEL_CHOICES}, got {value!r}")
    if key == "optim" and value not in {o.value for o in OptimizerNames}:
        raise OmniArgumentError(module, key, f"unknown optimizer {value!r}")
    if key == "lr_scheduler_type" and value not in {s.value for s in SchedulerType}:
        raise OmniArgumentError(module, key, f"unknown scheduler {value!r}")
    if key == "lr_scheduler_type" and value in ("reduce_lr_on_plateau", "greedy"):
        raise OmniArgumentError(module, key, f"{value!r} steps on metrics, which per-module schedulers do not get")
    if key == "fsdp_plugin" and value:
        check_fsdp_plugin(module, value)
    if key == "lora" and value:
        check_lora(module, value)
    return value


@dataclass
class ModuleArguments:
    """One module's resolved settings (top-level defaults with its overlay applied)."""

    name: str
    trainable: bool = True
    lora: dict | None = None
    lora_from_module: bool = False       # written under modules.<name> (then it must match something)
    learning_rate: float = 5e-5
    weight_decay: float = 0.0
    optim: str = "adamw_torch"
    optim_args: str | None = None
    lr_scheduler_type: str = "linear"
    lr_scheduler_kwargs: dict = field(default_factory=dict)
    warmup_steps: float = 0
    max_grad_norm: float | None = 1.0
    activation_checkpointing: bool = False
    parallel: str = "ddp"
    parallel_from_module: bool = False   # a frozen module is wrapped only when its own entry asks
    fsdp_plugin: dict = field(default_factory=dict)

    def warmup_steps_for(self, num_training_steps: int | None) -> int:
        """As TrainingArguments 5.x: a value < 1 is a ratio of the training steps."""
        if self.warmup_steps >= 1 or self.warmup_steps == 0:
            return int(self.warmup_steps)
        if num_training_steps is None:
            raise OmniArgumentError(self.name, "warmup_steps", "a ratio needs the number of training steps")
        return math.ceil(num_training_steps * self.warmup_steps)


@dataclass
class OmniTrainingArguments(TrainingArguments):
    """TrainingArguments with per-module overlays. See design.md section 2 for every key."""

    modules: dict | str | None = field(
        default=None, metadata={"help": "Per-module overlays, {name: {key: value}} (JSON on the CLI)."})
    lora: dict | str | None = field(
        default=None, metadata={"help": "peft.LoraConfig fields applied to every module (JSON on the CLI)."})
    parallel: str = field(
        default="ddp", metadata={"help": "fsdp | ddp | none: how trainable modules are wrapped under a process group."})
    fsdp_plugin: dict | str | None = field(
        default=None, metadata={"help": "Default FSDP2 plugin settings for every fsdp module (JSON on the CLI)."})
    fsdp_scope: str = field(
        default="module", metadata={"help": "module: each module wraps itself | model: one wrap of the whole model."})
    grad_clip_scope: str = field(
        default="per_module", metadata={"help": "per_module: each module to its own max_grad_norm | global."})
    save_async: bool = field(default=False, metadata={"help": "Save checkpoints asynchronously (DCP async_save)."})
    merge_lora_on_export: bool = field(default=False, metadata={"help": "Merge LoRA into plain weights on export."})

    def __post_init__(self):
        self._refuse_trainer_parallelism()
        for key in ("modules", "lora", "fsdp_plugin"):
            value = getattr(self, key)
            if isinstance(value, str):
                try:
                    setattr(self, key, json.loads(value))
                except json.JSONDecodeError as err:
                    raise OmniArgumentError(None, key, f"expected a JSON object, got {value!r} ({err})") from None
        for f in dataclasses.fields(TrainingArguments):
            value = getattr(self, f.name)
            if isinstance(value, str) and "float" in str(f.type):
                setattr(self, f.name, _as_number(None, f.name, value))
        super().__post_init__()
        # `activation_checkpointing` at top level is every module's default; Trainer must never apply it to the
        # composed model as a whole, so it is kept here and hidden from Trainer.
        self.module_activation_checkpointing = bool(self.activation_checkpointing)
        self.activation_checkpointing = self.gradient_checkpointing = False
        self._validate()

    def _refuse_trainer_parallelism(self) -> None:
        if self.fsdp:
            raise OmniArgumentError(None, "fsdp", "Trainer's global FSDP is not used by hf_omni; set `parallel: fsdp` "
                                    "and `fsdp_plugin` (top level or under modules.<name>) instead")
        if self.fsdp_config is not None:
            raise OmniArgumentError(None, "fsdp_config", "use `fsdp_plugin` (top level or under modules.<name>)")
        gc, ac = self.gradient_checkpointing, self.activation_checkpointing
        if gc is not None and (ac is None or gc != ac):
            raise OmniArgumentError(None, "gradient_checkpointing", "use `activation_checkpointing` (top level: every "
                                    "module's default; or per module under modules.<name>)")
        if self.fp16:
            raise OmniArgumentError(None, "fp16", "per-module optimizers share no GradScaler; use bf16")

    def _validate(self) -> None:
        for choice_key, choices in (("parallel", PARALLEL_CHOICES), ("fsdp_scope", FSDP_SCOPES),
                                    ("grad_clip_scope", GRAD_CLIP_SCOPES)):
            if getattr(self, choice_key) not in choices:
                raise OmniArgumentError(None, choice_key, f"must be one of {choices}, got {getattr(self, choice_key)!r}")
        for key in ("learning_rate", "weight_decay", "warmup_steps", "max_grad_norm"):
            check_value(None, key, getattr(self, key))
        if self.lora is not None:
            check_value(None, "lora", self.lora)
        if self.fsdp_plugin is not None:
            check_value(None, "fsdp_plugin", self.fsdp_plugin)
        if self.modules is None:
            self.modules = {}
        _check_type(None, "modules", self.modules, (dict,))
        for name, overlay in self.modules.items():
            if overlay is None:
                overlay = self.modules[name] = {}
            if not isinstance(overlay, dict):
                raise OmniArgumentError(name, "(entry)", f"expected a mapping of keys, got {type(overlay).__name__}")
            for key in list(overlay):
                if key not in MODULE_KEYS:
                    raise OmniArgumentError(name, key, f"unknown key; known: {sorted(MODULE_KEYS)}")
                if overlay[key] is not None or key in DICT_KEYS or key in ("optim_args", "max_grad_norm"):
                    overlay[key] = check_value(name, key, overlay[key]) if overlay[key] is not None else None
                else:
                    raise OmniArgumentError(name, key, "null only removes dict or optional values")
            if self.grad_clip_scope == "global" and "max_grad_norm" in overlay:
                raise OmniArgumentError(name, "max_grad_norm", "grad_clip_scope is global: all modules clip to the "
                                        "top-level max_grad_norm")
            if self.fsdp_scope == "model":
                for key in ("parallel", "fsdp_plugin"):
                    if key in overlay:
                        raise OmniArgumentError(name, key, "fsdp_scope is model: the composed model is wrapped once "
                                                "with the top-level fsdp_plugin")

    # -- resolution ------------------------------------------------------------------------------
    def module_defaults(self) -> dict[str, Any]:
        """Top-level values of every per-module key (`trainable` is per-module only)."""
        return {
            "lora": self.lora,
            "learning_rate": float(self.learning_rate),
            "weight_decay": float(self.weight_decay),
            "optim": self.optim.value if hasattr(self.optim, "value") else str(self.optim),
            "optim_args": self.optim_args,
            "lr_scheduler_type": getattr(self.lr_scheduler_type, "value", self.lr_scheduler_type),
            "lr_scheduler_kwargs": dict(self.lr_scheduler_kwargs or {}),
            "warmup_steps": self.warmup_steps,
            "max_grad_norm": self.max_grad_norm,
            "activation_checkpointing": self.module_activation_checkpointing,
            "parallel": self.parallel,
            "fsdp_plugin": dict(self.fsdp_plugin or {}),
        }

    def resolve_modules(self, names: list[str]) -> dict[str, ModuleArguments]:
        """One `ModuleArguments` per module of the model; unknown names in `modules:` are an error."""
        for name in self.modules:
            if name not in names:
                raise OmniArgumentError(name, "(module)", f"no such module in the model; modules: {list(names)}")
        defaults = self.module_defaults()
        resolved = {}
        for name in names:
            overlay = self.modules.get(name, {})
            values = {key: merge_overlay(defaults.get(key), overlay[key]) if key in overlay else defaults.get(key)
                      for key in defaults}
            for key in DICT_KEYS:
                values[key] = values[key] or ({} if key != "lora" else None)
            values["max_grad_norm"] = values["max_grad_norm"] or 0.0
            trainable = overlay.get("trainable", True)
            if not trainable:
                values["lora"] = None
            resolved[name] = ModuleArguments(
                name=name, trainable=trainable, lora_from_module=overlay.get("lora") is not None,
                parallel_from_module="parallel" in overlay, **values)
        return resolved
