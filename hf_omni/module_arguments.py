"""`ModuleArguments`: one module's settings, and the single declaration of every per-module key.

Each key is a dataclass field whose metadata carries its types, nullability, bounds, choices and help, as
Accelerate's plugin dataclasses do; `MODULE_KEYS`, the validation of an overlay, the merge of an overlay over the
top-level defaults and the README's key table are all derived from these fields. `FsdpSettings` declares the
`fsdp_plugin` keys the same way, with their defaults.
"""

from __future__ import annotations

import math
from dataclasses import MISSING, dataclass, field, fields
from typing import Any

from .errors import OmniArgumentError

NUMBER = (int, float)
MIXED_PRECISION_NAMES = ("no", "bf16", "fp16")
MIXED_PRECISION_KEYS = ("param_dtype", "reduce_dtype", "output_dtype")
MIXED_PRECISION_DTYPES = ("bfloat16", "float16", "float32")


def key(default: Any, types: tuple, help: str, *, nullable: bool = False, minimum: float | None = None,
        choices=None, check=None, top_level: str | None = "same") -> Any:
    """Declare a per-module (or `fsdp_plugin`) key. `choices`: a tuple or a callable returning one; `check(module,
    value)`: a deeper validation; `top_level`: the OmniTrainingArguments attribute that is every module's default
    (None: per-module only)."""
    metadata = {"key": True, "types": types, "help": help, "nullable": nullable, "minimum": minimum,
                "choices": choices, "check": check, "top_level": top_level}
    if isinstance(default, (dict, list)):
        return field(default_factory=lambda: type(default)(default), metadata=metadata)
    return field(default=default, metadata=metadata)


def merge_overlay(base: Any, overlay: Any) -> Any:
    """Dicts merge key by key (recursively); lists and scalars replace; `None` removes the inherited value."""
    if isinstance(base, dict) and isinstance(overlay, dict):
        out = dict(base)
        for name, value in overlay.items():
            if value is None:
                out.pop(name, None)
            else:
                out[name] = merge_overlay(base.get(name), value)
        return out
    return overlay


def as_number(module: str | None, name: str, value: Any) -> Any:
    """YAML reads `1e-4` as a string: accept numeric strings for numeric keys."""
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            raise OmniArgumentError(module, name, f"expected a number, got {value!r}") from None
    return value


def check_type(module: str | None, name: str, value: Any, types: tuple) -> None:
    names = "/".join("null" if t is type(None) else t.__name__ for t in types)
    if (isinstance(value, bool) and bool not in types) or not isinstance(value, types):
        raise OmniArgumentError(module, name, f"expected {names}, got {type(value).__name__} {value!r}")


def check_field(module: str | None, name: str, value: Any, meta: dict) -> Any:
    """Validate one declared key's value (coercing numeric strings); returns the value to use."""
    if value is None:
        if not meta["nullable"]:
            raise OmniArgumentError(module, name, "null only removes dict or optional values")
        return None
    if meta["types"] is NUMBER or set(NUMBER) <= set(meta["types"]):
        value = as_number(module, name, value)
    check_type(module, name, value, meta["types"])
    if meta["minimum"] is not None and value < meta["minimum"]:
        raise OmniArgumentError(module, name, f"must be >= {meta['minimum']}, got {value}")
    choices = meta["choices"]() if callable(meta["choices"]) else meta["choices"]
    if choices is not None and value not in choices:
        raise OmniArgumentError(module, name, f"must be one of {tuple(choices)}, got {value!r}")
    if meta["check"] is not None:
        meta["check"](module, value)
    return value


def declared(cls) -> dict[str, Any]:
    """The declared keys of `cls`: name -> dataclass field."""
    return {f.name: f for f in fields(cls) if f.metadata.get("key")}


# -- fsdp_plugin ----------------------------------------------------------------------------------------
def check_mixed_precision(module: str | None, value: Any) -> None:
    if isinstance(value, str) and value not in MIXED_PRECISION_NAMES:
        raise OmniArgumentError(module, "fsdp_plugin.mixed_precision",
                                f"must be one of {MIXED_PRECISION_NAMES} or a dict, got {value!r}")
    if isinstance(value, dict):
        for name, dtype in value.items():
            if name not in MIXED_PRECISION_KEYS or dtype not in MIXED_PRECISION_DTYPES:
                raise OmniArgumentError(module, f"fsdp_plugin.mixed_precision.{name}",
                                        f"keys {MIXED_PRECISION_KEYS}, values {MIXED_PRECISION_DTYPES}; got {dtype!r}")


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
        None, (str, dict), "`no` | `bf16` | `fp16` | {param_dtype, reduce_dtype, output_dtype} as dtype names",
        nullable=True, check=check_mixed_precision, top_level=None)
    cpu_offload: bool = key(False, (bool,), "keep sharded parameters on CPU", top_level=None)
    cpu_ram_efficient_loading: bool = key(False, (bool,), "Accelerate's flag (hf_omni's `empty_init` does this)",
                                          top_level=None)
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


# -- per-module keys ------------------------------------------------------------------------------------
def _optimizer_names():
    from transformers.training_args import OptimizerNames

    return {o.value for o in OptimizerNames}


def _scheduler_names():
    from transformers import SchedulerType

    # metric-driven schedulers step on eval metrics, which per-module schedulers do not get
    return {s.value for s in SchedulerType} - {"reduce_lr_on_plateau", "greedy"}


def _check_lora(module: str | None, lora: dict) -> None:
    from peft import LoraConfig

    try:
        LoraConfig(**lora)
    except (TypeError, ValueError) as err:
        raise OmniArgumentError(module, "lora", f"not a valid peft.LoraConfig: {err}") from None


def _check_fsdp(module: str | None, settings: dict) -> None:
    FsdpSettings.check_overlay(module, settings)


PARALLEL_CHOICES = ("fsdp", "ddp", "none")


@dataclass
class ModuleArguments:
    """One module's resolved settings: the top-level defaults with its `modules.<name>` overlay applied."""

    name: str
    trainable: bool = key(True, (bool,), "false: fully frozen (no LoRA, no optimizer, eval mode, no checkpoint "
                          "state)", top_level=None)
    lora: dict | None = key(None, (dict,), "peft.LoraConfig fields; only the adapters train", nullable=True,
                            check=_check_lora)
    learning_rate: float = key(5e-5, NUMBER, "the module's optimizer learning rate", minimum=0)
    weight_decay: float = key(0.0, NUMBER, "weight decay (not on biases and norms)", minimum=0)
    optim: str = key("adamw_torch", (str,), "a TrainingArguments `optim` name", choices=_optimizer_names)
    optim_args: str | None = key(None, (str,), "TrainingArguments `optim_args`", nullable=True)
    lr_scheduler_type: str = key("linear", (str,), "a TrainingArguments scheduler name (not metric-driven ones)",
                                 choices=_scheduler_names)
    lr_scheduler_kwargs: dict = key({}, (dict,), "extra scheduler arguments", nullable=True)
    warmup_steps: float = key(0, NUMBER, "warmup steps; < 1 is a ratio of the training steps", minimum=0)
    max_grad_norm: float | None = key(1.0, NUMBER, "clip the module's gradients to this norm (0 or null: off)",
                                      nullable=True, minimum=0)
    activation_checkpointing: bool = key(False, (bool,), "recompute activations in backward",
                                         top_level="module_activation_checkpointing")
    parallel: str = key("ddp", (str,), "fsdp | ddp | none: how the module is wrapped under a process group",
                        choices=PARALLEL_CHOICES)
    fsdp_plugin: dict = key({}, (dict,), "FsdpSettings for a `parallel: fsdp` module (merged key by key)",
                            nullable=True, check=_check_fsdp)
    # derived from where a value came from, not keys
    lora_from_module: bool = False       # written under modules.<name> (then it must match something)
    parallel_from_module: bool = False   # a frozen module is wrapped only when its own entry asks

    def warmup_steps_for(self, num_training_steps: int | None) -> int:
        """As TrainingArguments 5.x: a value < 1 is a ratio of the training steps."""
        if self.warmup_steps >= 1 or self.warmup_steps == 0:
            return int(self.warmup_steps)
        if num_training_steps is None:
            raise OmniArgumentError(self.name, "warmup_steps", "a ratio needs the number of training steps")
        return math.ceil(num_training_steps * self.warmup_steps)

    def fsdp_settings(self) -> FsdpSettings:
        return FsdpSettings.from_dict(self.name, self.fsdp_plugin or {})


MODULE_FIELDS = declared(ModuleArguments)
MODULE_KEYS: tuple[str, ...] = tuple(MODULE_FIELDS)


def field_help(name: str) -> str:
    return MODULE_FIELDS[name].metadata["help"]


def check_module_key(module: str | None, name: str, value: Any) -> Any:
    """Validate one per-module key as written (unknown keys are an error naming the module)."""
    if name not in MODULE_FIELDS:
        raise OmniArgumentError(module, name, f"unknown key; known: {sorted(MODULE_KEYS)}")
    return check_field(module, name, value, dict(MODULE_FIELDS[name].metadata))


def default_of(f) -> Any:
    return f.default_factory() if f.default_factory is not MISSING else f.default


def key_table() -> str:
    """The README's per-module key table, generated from the declarations."""
    rows = ["| key | default | top-level default from | what it does |", "|---|---|---|---|"]
    for name, f in MODULE_FIELDS.items():
        top = f.metadata["top_level"]
        source = "per-module only" if top is None else ("`activation_checkpointing`" if top != "same" else f"`{name}`")
        rows.append(f"| `{name}` | `{default_of(f)!r}` | {source} | {f.metadata['help']} |")
    rows += ["", "| `fsdp_plugin` key | default | what it does |", "|---|---|---|"]
    for name, f in declared(FsdpSettings).items():
        rows.append(f"| `{name}` | `{default_of(f)!r}` | {f.metadata['help']} |")
    return "\n".join(rows)
