"""Everything of `transformers.Trainer` that OmniTrainer relies on, in one registry checked against the installed
Trainer (its private API changes between minor releases): the methods it overrides or calls, with the parameter
names it relies on, and the instance attributes it reads or sets."""

from __future__ import annotations

import functools
import inspect

from transformers import Trainer

OVERRIDES, CALLS = "overrides", "calls"
# method -> (what OmniTrainer does with it, the parameter names it relies on)
TRAINER_METHODS: dict[str, tuple[str, tuple[str, ...]]] = {
    "_prepare_for_training": (OVERRIDES, ("self", "max_steps", "train_dataloader", "resume_from_checkpoint")),
    "create_optimizer": (OVERRIDES, ("self", "model")),
    "create_scheduler": (OVERRIDES, ("self", "num_training_steps", "optimizer")),
    "compute_loss": (OVERRIDES, ("self", "model", "inputs", "return_outputs", "num_items_in_batch")),
    "get_batch_samples": (OVERRIDES, ("self", "epoch_iterator", "num_batches", "device")),
    "training_step": (OVERRIDES, ("self", "model", "inputs", "num_items_in_batch")),
    "_clip_grad_norm": (OVERRIDES, ("self", "model")),
    "_get_grad_norm": (OVERRIDES, ("self", "model", "grad_norm")),
    "log": (OVERRIDES, ("self", "logs", "start_time")),
    "save_model": (OVERRIDES, ("self", "output_dir", "_internal_call")),
    "_move_model_to_device": (OVERRIDES, ("self", "model", "device")),
    "train": (OVERRIDES, ("self", "resume_from_checkpoint", "trial", "ignore_keys_for_eval")),
    "evaluate": (OVERRIDES, ("self", "eval_dataset", "ignore_keys", "metric_key_prefix")),
    "predict": (OVERRIDES, ("self", "test_dataset", "ignore_keys", "metric_key_prefix")),
    "_save_checkpoint": (OVERRIDES, ("self", "model", "trial")),
    "_load_from_checkpoint": (OVERRIDES, ("self", "resume_from_checkpoint", "model")),
    "_load_rng_state": (OVERRIDES, ("self", "checkpoint")),
    "_save_rng_state": (OVERRIDES, ("self", "output_dir")),
    "_load_best_model": (OVERRIDES, ("self",)),
    "_load_optimizer_and_scheduler": (OVERRIDES, ("self", "checkpoint")),
    "_load_scaler": (OVERRIDES, ("self", "checkpoint")),
    "prediction_step": (OVERRIDES, ("self", "model", "inputs", "prediction_loss_only", "ignore_keys")),
    "get_eval_dataloader": (OVERRIDES, ("self", "eval_dataset")),
    "get_test_dataloader": (OVERRIDES, ("self", "test_dataset")),
    "_get_train_sampler": (OVERRIDES, ("self", "train_dataset")),
    "push_to_hub": (OVERRIDES, ("self", "commit_message", "blocking", "token", "revision", "private", "kwargs")),
    "_push_from_checkpoint": (OVERRIDES, ("self", "checkpoint_folder")),
    "_get_output_dir": (CALLS, ("self", "trial")),
    "init_hf_repo": (CALLS, ("self", "token", "private")),
    "_finish_current_push": (CALLS, ("self",)),
}
# instance attributes of Trainer that OmniTrainer reads or sets (each must still be one Trainer's code uses)
TRAINER_ATTRIBUTES = ("model_wrapped", "callback_handler", "push_in_progress", "label_smoother", "hub_model_id",
                      "_train_batch_size", "label_names", "can_return_loss")


@functools.cache
def trainer_source() -> str:
    """The installed `transformers/trainer.py`, read once."""
    return inspect.getsource(inspect.getmodule(Trainer))


def check_trainer_hooks(trainer_cls: type = Trainer) -> None:
    """Fail loudly, naming the method or attribute, when something of Trainer that OmniTrainer relies on is gone or
    changed signature."""
    for name, (role, expected) in TRAINER_METHODS.items():
        method = getattr(trainer_cls, name, None)
        if method is None:
            raise RuntimeError(f"hf_omni: transformers.Trainer.{name} no longer exists; OmniTrainer {role} it")
        params = tuple(inspect.signature(method).parameters)
        if params != expected:
            raise RuntimeError(f"hf_omni: transformers.Trainer.{name} changed signature: {params} != "
                               f"{expected}; OmniTrainer {role} it")
    for attribute in TRAINER_ATTRIBUTES:
        if f"self.{attribute}" not in trainer_source():
            raise RuntimeError(f"hf_omni: transformers.Trainer no longer uses self.{attribute}; OmniTrainer relies "
                               "on it")
