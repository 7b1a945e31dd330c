"""The fate of every `TrainingArguments` field under OmniTrainer, stated once:

- honoured: Trainer's own code reads it and runs unchanged on the composed model;
- per module: a `modules:` key, and the top-level value is every module's default;
- hf_omni: hf_omni does what Trainer would (its own checkpoints, pushes, smoothing inside the modules, ...);
- refused: `OmniTrainingArguments` raises at parse time, naming the field and what to use instead;
- no effect: nothing in Trainer reads it.

`tests/test_trainer_fields.py` fails when the installed TrainingArguments has a field with no fate here (or a fate
names a field it lacks); docs/configuration.md's table is `fates_table()`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

from .module import MODULE_FIELDS

HONOURED, PER_MODULE, HF_OMNI, REFUSED, NO_EFFECT = "honoured", "per module", "hf_omni", "refused", "no effect"

_TRAINER = "Trainer's own"
_FATES: dict[str, tuple[str, str]] = {
    "output_dir": (HF_OMNI, "checkpoints, exports, `frozen/<module>/` and offline caches live under it"),
    "per_device_train_batch_size": (HONOURED, f"{_TRAINER} dataloaders"),
    "num_train_epochs": (HONOURED, f"{_TRAINER} loop; its step count sets every module's schedule"),
    "max_steps": (HONOURED, f"{_TRAINER} loop; every module's schedule runs over it"),
    "adam_beta1": (HF_OMNI, "every module's Adam optimizer"),
    "adam_beta2": (HF_OMNI, "every module's Adam optimizer"),
    "adam_epsilon": (HF_OMNI, "every module's Adam optimizer"),
    "gradient_accumulation_steps": (HONOURED, f"{_TRAINER} loop; inside a window each module syncs as its "
                                              "`sync_each_batch` says (`fsdp`: every micro-step; `ddp`: the last)"),
    "average_tokens_across_devices": (HONOURED, "the token count reaches the loss through `forward(**kw)`"),
    "label_smoothing_factor": (HF_OMNI, "smoothed inside each module that computes a causal / masked LM loss, on "
                                        "the targets it uses (`label_smoothing.py`)"),
    "bf16": (HONOURED, "Accelerate's autocast around the composed forward"),
    "fp16": (HONOURED, "Accelerate's GradScaler, shared by every module's optimizer (CUDA)"),
    "bf16_full_eval": (HONOURED, f"{_TRAINER} evaluation loop (casts every module)"),
    "fp16_full_eval": (HONOURED, f"{_TRAINER} evaluation loop (casts every module)"),
    "tf32": (HONOURED, "a global backend flag"),
    "activation_checkpointing_kwargs": (PER_MODULE, "`every_n_layers` and `offload` as Trainer passes them"),
    "gradient_checkpointing_kwargs": (PER_MODULE, "Trainer copies it into `activation_checkpointing_kwargs`"),
    "use_cache": (HF_OMNI, "set on every module whose config has it, as Trainer sets it on its one model"),
    "neftune_noise_alpha": (HF_OMNI, "noise on the token embeddings of `OmniModel.input_embeddings_module` (or of "
                                     "the one module that has them)"),
    "torch_empty_cache_steps": (HONOURED, f"{_TRAINER} training step (frees the accelerator's cache; nothing on "
                                          "CPU)"),
    "auto_find_batch_size": (HONOURED, f"{_TRAINER} retry; each try builds fresh per-module optimizers"),
    "include_num_input_tokens_seen": (HONOURED, "counts the `input_ids` of each batch (`OmniModel.main_input_name`);"
                                                " image or audio positions are not tokens seen"),
    "eval_use_gather_object": (HONOURED, f"{_TRAINER} evaluation loop"),
    "include_for_metrics": (HONOURED, f"{_TRAINER} evaluation loop (`inputs` are the `input_ids`)"),
    "per_device_eval_batch_size": (HONOURED, f"{_TRAINER} evaluation, and the offline encoding batch"),
    "save_only_model": (HF_OMNI, "module folders without `state/`, marked not resumable; `load_best_model_at_end` "
                                 "reads them"),
    "save_strategy": (HONOURED, "when to save; the save is hf_omni's per-module checkpoint"),
    "save_steps": (HONOURED, "when to save; the save is hf_omni's per-module checkpoint"),
    "save_total_limit": (HF_OMNI, "rotation counts complete checkpoints only, never the best or one being pushed"),
    "enable_jit_checkpoint": (HONOURED, "its SIGTERM save is hf_omni's checkpoint"),
    "push_to_hub": (HF_OMNI, "per-module repos plus the composition repo (`hub_layout`)"),
    "hub_token": (HF_OMNI, "given to huggingface_hub only, written nowhere"),
    "hub_private_repo": (HF_OMNI, "every repo of the push"),
    "hub_model_id": (HF_OMNI, "the composition repo; modules default to `<hub_model_id>-<module>`"),
    "hub_strategy": (HF_OMNI, "checkpoints pushed in the background after their marker"),
    "hub_always_push": (HF_OMNI, "a save while a push runs is pushed after it"),
    "hub_revision": (HF_OMNI, "the branch of every repo of the push"),
    "load_best_model_at_end": (HF_OMNI, "every module's weights read back from the best checkpoint"),
    "ignore_data_skip": (HONOURED, f"{_TRAINER} batch skipping on resume"),
    "restore_callback_states_from_checkpoint": (HONOURED, "`trainer_state.json` holds the callback states"),
    "seed": (HONOURED, "set before any module is wrapped or given an adapter"),
    "use_cpu": (HONOURED, "the device"),
    "accelerator_config": (HONOURED, "dataloader and accumulation settings (`sync_each_batch` syncs every module "
                                     "on every micro-step)"),
    "remove_unused_columns": (HONOURED, "keeps the columns `forward` names; one meant to pass through `**kw` needs "
                                        "`remove_unused_columns: false`"),
    "label_names": (HONOURED, "default: the `forward` parameters with 'label' in their name"),
    "train_sampling_strategy": (HONOURED, "`group_by_length` measures each row's `input_ids`; `group_by_modality` "
                                          "goes with `random` or `sequential`"),
    "length_column_name": (HONOURED, "read from a `datasets.Dataset` only (offline-served rows are measured)"),
    "ddp_backend": (HONOURED, "the process group's backend"),
    "ddp_timeout": (HONOURED, "the process group's timeout"),
    "debug": (HONOURED, f"{_TRAINER} underflow / overflow hooks"),
    "do_train": (NO_EFFECT, "a script convention; Trainer reads it nowhere"),
    "do_eval": (NO_EFFECT, "a script convention; Trainer reads it nowhere"),
    "do_predict": (NO_EFFECT, "a script convention; Trainer reads it nowhere"),
    "resume_from_checkpoint": (NO_EFFECT, "Trainer reads it nowhere: pass `train(resume_from_checkpoint=...)`"),
    "local_rank": (NO_EFFECT, "the launcher's placeholder; read nowhere"),
}
for _name in ("logging_strategy", "logging_steps", "logging_first_step", "log_on_each_node", "logging_nan_inf_filter",
              "log_level", "log_level_replica", "disable_tqdm", "report_to", "run_name", "project", "trackio_space_id",
              "trackio_bucket_id", "trackio_static_space_id"):
    _FATES[_name] = (HONOURED, f"{_TRAINER} logging; OmniTrainer adds per-module figures to each log")
for _name in ("eval_strategy", "eval_steps", "eval_delay", "prediction_loss_only", "eval_on_start",
              "eval_do_concat_batches", "eval_accumulation_steps", "batch_eval_metrics", "metric_for_best_model",
              "greater_is_better"):
    _FATES[_name] = (HONOURED, f"{_TRAINER} evaluation")
for _name in ("full_determinism", "data_seed", "dataloader_drop_last", "dataloader_num_workers",
              "dataloader_pin_memory", "dataloader_persistent_workers", "dataloader_prefetch_factor",
              "dataloader_multiprocessing_context", "dataloader_in_order", "skip_memory_metrics"):
    _FATES[_name] = (HONOURED, _TRAINER)


@dataclasses.dataclass(frozen=True)
class Refusal:
    """When a field's value is refused (read from the arguments as written, before TrainingArguments' own
    post-init changes them), and what to use instead."""

    refused: Callable[[Any], bool]
    message: str


def _set(name: str) -> Callable[[Any], bool]:
    return lambda args: getattr(args, name) not in (None, False, "", [])


def _no_cuda(args) -> bool:
    import torch

    return bool(args.fp16) and (bool(args.use_cpu) or not torch.cuda.is_available())


COMPILE = ("Trainer would compile the composed model as a whole, around the per-module wrapping; per-module "
            "compilation is not supported yet")
REFUSALS: dict[str, Refusal] = {
    "fsdp": Refusal(_set("fsdp"), "Trainer's global FSDP is not used by hf_omni; set `parallel: fsdp` and "
                    "`fsdp_plugin` (top level or under modules.<name>) instead"),
    "fsdp_config": Refusal(_set("fsdp_config"), "use `fsdp_plugin` (top level or under modules.<name>)"),
    "deepspeed": Refusal(_set("deepspeed"), "one global engine for the whole model; use `parallel: fsdp` with "
                         "`fsdp_plugin` per module (modules.<name>.parallel / modules.<name>.fsdp_plugin)"),
    "parallelism_config": Refusal(_set("parallelism_config"), "one global device mesh for the whole model; set "
                                  "`parallel` and `parallelism` per module under modules.<name>"),
    "fp16": Refusal(_no_cuda, "fp16 training needs CUDA (its GradScaler); on CPU use bf16"),
    "torch_compile": Refusal(_set("torch_compile"), COMPILE),
    "torch_compile_backend": Refusal(_set("torch_compile_backend"), COMPILE),
    "torch_compile_mode": Refusal(_set("torch_compile_mode"), COMPILE),
    "use_liger_kernel": Refusal(_set("use_liger_kernel"), "Liger patches one model by its type; the composed model's "
                                "type is hf_omni, so it would patch nothing"),
    "liger_kernel_config": Refusal(_set("liger_kernel_config"), "Liger kernels are not applied per module (see "
                                   "use_liger_kernel)"),
    "save_on_each_node": Refusal(_set("save_on_each_node"), "hf_omni writes checkpoints from global rank 0 to a "
                                 "file system every node shares; another node's first rank would write beside it"),
    "optim_target_modules": Refusal(_set("optim_target_modules"), "only GaLore / APOLLO read it, and they build "
                                    "their own parameter groups, which per-module optimizers do not support"),
}
_FATES.update((name, (REFUSED, refusal.message)) for name, refusal in REFUSALS.items() if name != "fp16")
_FATES["gradient_checkpointing"] = (REFUSED, "use `activation_checkpointing` (top level: every module's default)")


def fates() -> dict[str, tuple[str, str]]:
    """field -> (fate, what happens), for every field hf_omni knows: per-module keys from their declarations."""
    from transformers import TrainingArguments

    out = dict(_FATES)
    for name, f in MODULE_FIELDS.items():
        top = f.metadata["top_level"]
        if name in TrainingArguments.__dataclass_fields__ and (top == "same" or name == "activation_checkpointing"):
            note = out.get(name, (None, ""))[1]
            out[name] = (PER_MODULE, f"`modules.<name>.{name}`" + (f"; {note}" if note else ""))
    return out


def unknown_fields(trainer_args_cls=None) -> tuple[list[str], list[str]]:
    """(fields of the installed TrainingArguments with no fate, fates of fields it does not have)."""
    from transformers import TrainingArguments

    names = {f.name for f in dataclasses.fields(trainer_args_cls or TrainingArguments)}
    known = set(fates())
    return sorted(names - known), sorted(known - names)


def fates_table() -> str:
    """docs/configuration.md's table: every TrainingArguments field and its fate."""
    from transformers import TrainingArguments

    known = fates()
    rows = ["| TrainingArguments field | fate | what happens |", "|---|---|---|"]
    for f in dataclasses.fields(TrainingArguments):
        fate, note = known.get(f.name, ("(none)", ""))
        if f.name == "fp16":
            fate = f"{fate}; refused without CUDA"
        rows.append(f"| `{f.name}` | {fate} | {note.replace('|', chr(92) + '|')} |")
    return "\n".join(rows)
