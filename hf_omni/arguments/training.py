"""`OmniTrainingArguments`: TrainingArguments plus a `modules:` section of per-module overlays.

Top-level values are every module's defaults; `modules.<name>` overlays them (dicts merge key by key,
lists and scalars replace, `null` removes the inherited value). Parsed with `HfArgumentParser` from YAML,
JSON or the CLI (`--modules` takes a JSON string). Every error is a `ValueError` naming the module and key,
raised at parse time when the arguments alone show it, else when the model is first seen (`OmniPlugin.prepare`).
The per-module keys are declared once, in `arguments.module.ModuleArguments`.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from typing import Any

from transformers import TrainingArguments

from ..core.errors import OmniArgumentError
from ..core.keys import as_number, check_type, default_of, merge_overlay
from ..hub.ids import HUB_LAYOUTS
from ..parallel.layout import refuse_at_top_level, refuse_lora, refuse_strategy
from ..parallel.strategy import STRATEGIES, check_settings, settings_keys
from .fields import COMPILE, REFUSALS
from .module import MODULE_FIELDS, MODULE_KEYS, ModuleArguments, check_module_key, field_help

FSDP_SCOPES = ("module", "model")
GRAD_CLIP_SCOPES = ("per_module", "global")
JSON_KEYS = ("modules", "lora", "fsdp_plugin", "parallelism", "ema")


@dataclass
class OmniTrainingArguments(TrainingArguments):
    """TrainingArguments with per-module overlays (docs/configuration.md lists every key)."""

    modules: dict | str | None = field(
        default=None, metadata={"help": "Per-module overlays, {name: {key: value}} (JSON on the CLI)."})
    lora: dict | str | None = field(default=None, metadata={"help": field_help("lora") + " (JSON on the CLI)"})
    parallel: str = field(default=default_of(MODULE_FIELDS["parallel"]), metadata={"help": field_help("parallel")})
    fsdp_plugin: dict | str | None = field(default=None, metadata={"help": field_help("fsdp_plugin") + " (JSON)"})
    parallelism: dict | str | None = field(default=None, metadata={
        "help": field_help("parallelism") + " (JSON on the CLI)"})
    master_dtype: str = field(default=default_of(MODULE_FIELDS["master_dtype"]),
                              metadata={"help": field_help("master_dtype")})
    ema: dict | str | None = field(default=None, metadata={"help": field_help("ema") + " (JSON on the CLI)"})
    export_ema: bool = field(default=False, metadata={"help": field_help("export_ema")})
    fsdp_scope: str = field(
        default="module", metadata={"help": "module: each module wraps itself | model: one wrap of the whole model."})
    grad_clip_scope: str = field(
        default="per_module", metadata={"help": "per_module: each module to its own max_grad_norm | global."})
    save_async: bool = field(default=False, metadata={
        "help": "Save checkpoints in the background (a writer process per rank); the loop waits only for the copies of what changes."})
    verify_checkpoint: bool = field(default=False, metadata={
        "help": "Record every checkpoint file's sha256 in its marker, and check them before resuming."})
    merge_lora_on_export: bool = field(default=False, metadata={"help": "Merge LoRA into plain weights on export."})
    offline_modules: list[str] | None = field(default=None, metadata={
        "help": "Fully frozen modules whose @offline_encoder outputs are cached and fed to forward instead."})
    offline_cache_dir: str | None = field(default=None, metadata={
        "help": "Where offline caches live (default <output_dir>/offline_cache)."})
    hub_layout: str | None = field(default=None, metadata={
        "help": "per_module (unset: the default of composed models): each module to its own repo plus the "
                "composition repo hub_model_id | single: one repo with a subfolder per module. Unset for an adopted "
                "model: one repo in its released format."})
    offline_cache: str = field(default="auto", metadata={
        "help": "auto: a stale offline cache is recomputed | read_only: a stale or missing one is an error."})
    group_by_modality: bool = field(default=False, metadata={
        "help": "Every global batch carries the same modalities (entry points with inputs) on every rank."})

    def __post_init__(self):
        self._refuse_global_settings()
        for name in JSON_KEYS:
            value = getattr(self, name)
            if isinstance(value, str):
                try:
                    setattr(self, name, json.loads(value))
                except json.JSONDecodeError as err:
                    raise OmniArgumentError(None, name, f"expected a JSON object, got {value!r} ({err})") from None
        for f in dataclasses.fields(TrainingArguments):
            value = getattr(self, f.name)
            if isinstance(value, str) and "float" in str(f.type):
                setattr(self, f.name, as_number(None, f.name, value))
        super().__post_init__()
        # `activation_checkpointing` at top level is every module's default; Trainer must never apply it to the
        # composed model as a whole, so it is kept here and hidden from Trainer.
        self.module_activation_checkpointing = bool(self.activation_checkpointing)
        self.activation_checkpointing = self.gradient_checkpointing = False
        self._validate()

    def _refuse_global_settings(self) -> None:
        """Trainer's global engines and what hf_omni does not do (`fields.REFUSALS`), each naming the key to
        use instead; read from the arguments as written, before TrainingArguments' post-init changes them."""
        for name, refusal in REFUSALS.items():
            if refusal.refused(self):
                raise OmniArgumentError(None, name, refusal.message)
        for variable in ("ACCELERATE_USE_FSDP", "ACCELERATE_USE_DEEPSPEED"):  # `accelerate launch --use_fsdp`, ...
            if os.environ.get(variable, "").lower() in ("1", "true", "yes"):
                raise OmniArgumentError(None, variable, "the launcher turns on Accelerate's one global engine for "
                                        "the whole model; launch without it and set `parallel: fsdp` per module")
        if os.environ.get("ACCELERATE_DYNAMO_BACKEND", "no").lower() != "no":  # `accelerate launch --dynamo_backend`
            raise OmniArgumentError(None, "ACCELERATE_DYNAMO_BACKEND", COMPILE)
        gc, ac = self.gradient_checkpointing, self.activation_checkpointing
        if gc or (gc is not None and ac is None):  # (both False: the values TrainingArguments itself leaves)
            raise OmniArgumentError(None, "gradient_checkpointing", "use `activation_checkpointing` (top level: every "
                                    "module's default; or per module under modules.<name>)")

    def _validate(self) -> None:
        for name, choices in (("fsdp_scope", FSDP_SCOPES), ("grad_clip_scope", GRAD_CLIP_SCOPES),
                              ("offline_cache", ("auto", "read_only")), ("hub_layout", (None, *HUB_LAYOUTS))):
            if getattr(self, name) not in choices:
                raise OmniArgumentError(None, name, f"must be one of {choices}, got {getattr(self, name)!r}")
        if self.group_by_modality and self.train_sampling_strategy not in ("random", "sequential"):
            raise OmniArgumentError(None, "group_by_modality", "groups the rows itself: it goes with "
                                    "train_sampling_strategy random or sequential, not "
                                    f"{self.train_sampling_strategy!r}")
        if isinstance(self.offline_modules, str):
            self.offline_modules = [self.offline_modules]
        if self.offline_modules is not None:
            check_type(None, "offline_modules", self.offline_modules, (list,))
            if not all(isinstance(m, str) for m in self.offline_modules):
                raise OmniArgumentError(None, "offline_modules", f"expected module names, got {self.offline_modules!r}")
            if self.offline_modules and self.fsdp_scope == "model":
                raise OmniArgumentError(None, "offline_modules", "fsdp_scope: model wraps every module, an offline "
                                        "one (on the meta device) included: use fsdp_scope: module")
        for name, value in self.module_defaults().items():
            check_module_key(None, name, value)
        refuse_at_top_level(self.module_defaults().get("parallelism"))
        if self.modules is None:
            self.modules = {}
        check_type(None, "modules", self.modules, (dict,))
        for name, overlay in self.modules.items():
            if overlay is None:
                overlay = self.modules[name] = {}
            if not isinstance(overlay, dict):
                raise OmniArgumentError(name, "(entry)", f"expected a mapping of keys, got {type(overlay).__name__}")
            for key in list(overlay):
                overlay[key] = check_module_key(name, key, overlay[key])
            if self.grad_clip_scope == "global" and "max_grad_norm" in overlay:
                raise OmniArgumentError(name, "max_grad_norm", "grad_clip_scope is global: all modules clip to the "
                                        "top-level max_grad_norm")
            for key in settings_keys():
                if overlay.get(key):  # a strategy's settings merged with the top level must still agree
                    check_settings(name, key, merge_overlay(getattr(self, key, None) or {}, overlay[key]))
            parallel = overlay.get("parallel", self.parallel)
            refuse_strategy(name, overlay.get("parallelism"), parallel)
            if "parallelism" in overlay and overlay["parallelism"] is not None and \
                    not STRATEGIES[parallel].takes_mesh:
                raise OmniArgumentError(name, "parallelism", "sets a mesh for `parallel: fsdp` modules; this one is "
                                        f"`parallel: {parallel}`")
            if self.fsdp_scope == "model":
                for key in ("parallel", "fsdp_plugin", "parallelism"):
                    if key in overlay:
                        raise OmniArgumentError(name, key, "fsdp_scope is model: the composed model is wrapped once "
                                                "with the top-level fsdp_plugin")

    # -- resolution ------------------------------------------------------------------------------
    def module_defaults(self) -> dict[str, Any]:
        """Top-level values of every per-module key that has one (`trainable` is per-module only)."""
        out = {}
        for name, f in MODULE_FIELDS.items():
            top = f.metadata["top_level"]
            if top is None:
                continue
            value = getattr(self, name if top == "same" else top)
            value = getattr(value, "value", value)  # OptimizerNames / SchedulerType enums: their names
            out[name] = dict(value) if isinstance(value, dict) else value
        out["learning_rate"] = float(out["learning_rate"])
        return out

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
                      for key in MODULE_KEYS if key in defaults}
            for key in ("lr_scheduler_kwargs", "fsdp_plugin", "activation_checkpointing_kwargs"):
                values[key] = values[key] or {}
            values["max_grad_norm"] = values["max_grad_norm"] or 0.0
            values.update({k: overlay.get(k) for k in ("push_to_hub", "hub_model_id", "offline_encoder",
                                                       "sync_each_batch")})  # per-module only
            if self.fsdp_scope == "model":  # the composed model is wrapped once, every module inside it
                values["parallel"] = "fsdp"
            trainable = overlay.get("trainable", True)
            if not trainable:
                values["lora"] = None
            margs = ModuleArguments(name=name, trainable=trainable, lora_from_module=overlay.get("lora") is not None,
                                    parallel_from_module="parallel" in overlay, **values)
            if margs.lora is not None:
                refuse_lora(name, margs.parallelism, margs.lora)
            for cls in STRATEGIES.values():  # settings merged from several levels must agree (min_num_params + classes)
                margs.strategy_settings(cls)
            resolved[name] = margs
        return resolved


def top_level_table() -> str:
    """docs/configuration.md's table of the keys OmniTrainingArguments adds to TrainingArguments (from the
    fields)."""
    own = [f for f in dataclasses.fields(OmniTrainingArguments) if f.name not in TrainingArguments.__dataclass_fields__]
    rows = ["| top-level key | default | what it does |", "|---|---|---|"]
    for f in own:
        if f.init and "help" in f.metadata:
            text = f.metadata["help"].replace("|", "\\|")  # a pipe inside a cell would split it
            rows.append(f"| `{f.name}` | `{f.default!r}` | {text} |")
    return "\n".join(rows)
