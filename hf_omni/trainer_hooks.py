"""The Trainer methods `OmniTrainer` overrides or calls, with the parameters it relies on, checked against the
installed Trainer (its private API changes between minor releases)."""

from __future__ import annotations

import inspect

from transformers import Trainer

# hook -> the parameter names we rely on (Trainer's private API changes between minor releases)
TRAINER_HOOKS: dict[str, tuple[str, ...]] = {
    "_prepare_for_training": ("self", "max_steps", "train_dataloader", "resume_from_checkpoint"),
    "create_optimizer": ("self", "model"),
    "create_scheduler": ("self", "num_training_steps", "optimizer"),
    "compute_loss": ("self", "model", "inputs", "return_outputs", "num_items_in_batch"),
    "_clip_grad_norm": ("self", "model"),
    "_get_grad_norm": ("self", "model", "grad_norm"),
    "log": ("self", "logs", "start_time"),
    "save_model": ("self", "output_dir", "_internal_call"),
    "_move_model_to_device": ("self", "model", "device"),
    "train": ("self", "resume_from_checkpoint", "trial", "ignore_keys_for_eval"),
    "_save_checkpoint": ("self", "model", "trial"),
    "_load_from_checkpoint": ("self", "resume_from_checkpoint", "model"),
    "_load_rng_state": ("self", "checkpoint"),
    "_save_rng_state": ("self", "output_dir"),
    "_load_best_model": ("self",),
    "_load_optimizer_and_scheduler": ("self", "checkpoint"),
    "_load_scaler": ("self", "checkpoint"),
    "evaluate": ("self", "eval_dataset", "ignore_keys", "metric_key_prefix"),
    "predict": ("self", "test_dataset", "ignore_keys", "metric_key_prefix"),
    "get_eval_dataloader": ("self", "eval_dataset"),
    "get_test_dataloader": ("self", "test_dataset"),
    "push_to_hub": ("self", "commit_message", "blocking", "token", "revision", "private", "kwargs"),
    "_push_from_checkpoint": ("self", "checkpoint_folder"),
}
# Trainer's private methods OmniTrainer calls without overriding them -> the parameter names it relies on
TRAINER_CALLS: dict[str, tuple[str, ...]] = {
    "_get_output_dir": ("self", "trial"),
    "init_hf_repo": ("self", "token", "private"),
    "_finish_current_push": ("self",),
}


def check_trainer_hooks(trainer_cls: type = Trainer) -> None:
    """Fail loudly, naming the method, when a Trainer method we override or call disappears or changes signature."""
    for table, role in ((TRAINER_HOOKS, "overrides"), (TRAINER_CALLS, "calls")):
        for name, expected in table.items():
            method = getattr(trainer_cls, name, None)
            if method is None:
                raise RuntimeError(f"hf_omni: transformers.Trainer.{name} no longer exists; OmniTrainer {role} it")
            params = tuple(inspect.signature(method).parameters)
            if params != expected:
                raise RuntimeError(f"hf_omni: transformers.Trainer.{name} changed signature: {params} != "
                                   f"{expected}; OmniTrainer {role} it")
