"""`ModuleArguments`: one module's settings, and the single declaration of every per-module key.

Each key is a dataclass field whose metadata carries its types, nullability, bounds, choices and help, as
Accelerate's plugin dataclasses do; `MODULE_KEYS`, the validation of an overlay, the merge of an overlay over the
top-level defaults and the key tables of docs/configuration.md are all derived from these fields (the
settings of each strategy, `fsdp_plugin`: its `Strategy.settings_class`, declared the same way).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from ..core.config import repo_id_error
from ..core.errors import OmniArgumentError
from ..core.keys import NUMBER, check_field, declared, default_of, key
from ..modules.ema import check_ema
from ..modules.precision import MASTER_DTYPES
from ..parallel.dims import check_parallelism
from ..parallel.strategy import STRATEGIES, Strategy, check_settings, settings_tables, strategy_names


# -- per-module keys ------------------------------------------------------------------------------------
def _optimizer_names():
    from transformers.training_args import OptimizerNames

    return {o.value for o in OptimizerNames}


UNSUPPORTED_OPTIMIZERS = {  # name prefix -> why a per-module optimizer cannot be one
    "galore_": "builds its own parameter groups from `optim_target_modules`",
    "apollo_": "builds its own parameter groups from `optim_target_modules`",
    "lomo": "steps inside backward (it needs the whole model), not per module",
    "adalomo": "steps inside backward (it needs the whole model), not per module",
    "schedule_free_": "needs train() / eval() calls that per-module optimizers do not make",
}


def _check_optim(module: str | None, name: str) -> None:
    for prefix, why in UNSUPPORTED_OPTIMIZERS.items():
        if name.startswith(prefix):
            raise OmniArgumentError(module, "optim", f"{name!r} {why}: not supported yet")


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
    check_settings(module, "fsdp_plugin", settings)


def _check_repo_id(module: str | None, repo_id: str) -> None:
    if repo_id_error(repo_id):
        raise OmniArgumentError(module, "hub_model_id", f"not a Hub repo id: {repo_id_error(repo_id)}")


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
    optim: str = key("adamw_torch", (str,), "a TrainingArguments `optim` name (not GaLore, APOLLO, LOMO or "
                     "schedule-free ones)", choices=_optimizer_names, check=_check_optim)
    optim_args: str | None = key(None, (str,), "TrainingArguments `optim_args`", nullable=True)
    lr_scheduler_type: str = key("linear", (str,), "a TrainingArguments scheduler name (not metric-driven ones)",
                                 choices=_scheduler_names)
    lr_scheduler_kwargs: dict = key({}, (dict,), "extra scheduler arguments", nullable=True)
    warmup_steps: float = key(0, NUMBER, "warmup steps; < 1 is a ratio of the training steps", minimum=0)
    max_grad_norm: float | None = key(1.0, NUMBER, "clip the module's gradients to this norm (0 or null: off)",
                                      nullable=True, minimum=0)
    master_dtype: str = key("auto", (str,), "trainable parameters and their optimizer state: `auto` (fp32 when the "
                            "run computes in bf16 / fp16, else as loaded), `float32`, `bfloat16` (pure bf16)",
                            choices=MASTER_DTYPES)
    ema: dict | None = key(None, (dict,), "EMA weights of its trained parameters, diffusers' EMAModel fields: {decay: "
                           "0.9999, min_decay: 0.0, update_after_step: 0, use_ema_warmup: false, inv_gamma: 1.0, "
                           "power: 2/3} (each optional; null: no EMA); sharded like the module, in `state/`",
                           nullable=True, check=check_ema)
    export_ema: bool = key(False, (bool,), "exports (`save_pretrained`, `save_model`, `hf-omni export`) and "
                           "`to_pipeline()` sampling use the EMA weights (needs `ema`)")
    activation_checkpointing: bool = key(False, (bool,), "recompute activations in backward",
                                         top_level="module_activation_checkpointing")
    activation_checkpointing_kwargs: dict = key({}, (dict,), "`activation_checkpointing_enable` arguments (default "
                                                "use_reentrant: false)", nullable=True)
    parallel: str = key("ddp", (str,), "`fsdp`, `ddp`, `none` or a name given to `hf_omni.register_strategy`: how "
                        "the module is wrapped under a process group", choices=strategy_names)
    fsdp_plugin: dict = key({}, (dict,), "FsdpSettings for a `parallel: fsdp` module (merged key by key)",
                            nullable=True, check=_check_fsdp)
    parallelism: dict | None = key(None, (dict,), "a `parallel: fsdp` module's mesh, Accelerate's ParallelismConfig "
                                   "fields: {dp_shard_size: N} full shard (default: the world), {dp_replicate_size: "
                                   "R, dp_shard_size: S} HSDP (R x S = world size), and each layout's `<name>_size` "
                                   "(docs/parallel.md's table: tensor and expert parallelism)",
                                   nullable=True, check=check_parallelism)
    sync_each_batch: bool | None = key(None, (bool,), "reduce its gradients on every micro-step of an accumulation "
                                       "window (unset: true for `fsdp`, whose gradients stay sharded; false for "
                                       "`ddp`, which all-reduces once at the window's last)", nullable=True,
                                       top_level=None)
    ddp_find_unused_parameters: bool | None = key(
        None, (bool,), "`parallel: ddp`: DDP's find_unused_parameters (unset: true unless activation checkpointing, "
        "as Trainer)", nullable=True)
    ddp_bucket_cap_mb: int | None = key(None, (int,), "`parallel: ddp`: DDP's bucket_cap_mb", nullable=True,
                                        minimum=1)
    ddp_broadcast_buffers: bool | None = key(None, (bool,), "`parallel: ddp`: DDP's broadcast_buffers (unset: "
                                             "true)", nullable=True)
    ddp_static_graph: bool | None = key(None, (bool,), "`parallel: ddp`: DDP's static_graph", nullable=True)
    push_to_hub: bool | None = key(None, (bool,), "with `push_to_hub`: true uploads the module, false links it "
                                   "(its `hub_model_id` or the Hub repo it was loaded from); unset: upload unless it "
                                   "is frozen and was loaded from the Hub", nullable=True, top_level=None)
    hub_model_id: str | None = key(None, (str,), "the module's own Hub repo (`hub_layout: per_module`; default "
                                   "`<hub_model_id>-<module>`), or the repo a `push_to_hub: false` module links to",
                                   nullable=True, check=_check_repo_id, top_level=None)
    offline_encoder: str | None = key(None, (str,), "an adopted model's method whose outputs this module's offline "
                                      "cache holds (`get_image_features`, `get_video_features`, or a submodule's: "
                                      "`thinker.get_image_features`); everything it runs must be in this module, "
                                      "frozen", nullable=True, top_level=None)
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

    def ddp_kwargs(self) -> dict:
        """DDP's arguments for this module, with Trainer's defaults."""
        find_unused = self.ddp_find_unused_parameters
        kwargs = {"find_unused_parameters": not self.activation_checkpointing if find_unused is None else find_unused}
        for name in ("bucket_cap_mb", "broadcast_buffers", "static_graph"):
            if getattr(self, f"ddp_{name}") is not None:
                kwargs[name] = getattr(self, f"ddp_{name}")
        return kwargs

    @property
    def strategy(self) -> type[Strategy]:
        """The class of its `parallel` strategy."""
        return STRATEGIES[self.parallel]

    def strategy_settings(self, strategy: type[Strategy] | None = None):
        """The typed settings of its strategy (or of `strategy`) from their key here, parsed; None without any."""
        strategy = strategy or self.strategy
        values = getattr(self, strategy.settings_key) if strategy.settings_key else None
        return strategy.parse_settings(self.name, values)


MODULE_FIELDS = declared(ModuleArguments)
MODULE_KEYS: tuple[str, ...] = tuple(MODULE_FIELDS)


def field_help(name: str) -> str:
    return MODULE_FIELDS[name].metadata["help"]


def check_module_key(module: str | None, name: str, value: Any) -> Any:
    """Validate one per-module key as written (unknown keys are an error naming the module)."""
    if name not in MODULE_FIELDS:
        raise OmniArgumentError(module, name, f"unknown key; known: {sorted(MODULE_KEYS)}")
    return check_field(module, name, value, dict(MODULE_FIELDS[name].metadata))


def key_table() -> str:
    """docs/configuration.md's per-module key tables, generated from the declarations."""
    rows = ["| key | default | top-level default from | what it does |", "|---|---|---|---|"]
    for name, f in MODULE_FIELDS.items():
        top = f.metadata["top_level"]
        source = "per-module only" if top is None else ("`activation_checkpointing`" if top != "same" else f"`{name}`")
        rows.append(f"| `{name}` | `{default_of(f)!r}` | {source} | {f.metadata['help']} |")
    return "\n".join(rows + settings_tables())
