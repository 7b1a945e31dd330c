"""`OmniTrainer`: `transformers.Trainer` over an `OmniPlugin`. Trainer's loop runs unchanged; only these
hooks are overridden (and checked against the installed Trainer by `check_trainer_hooks`):

- `_prepare_for_training`: the plugin wraps each module in place and builds the per-module optimizers and
  schedulers (Trainer would wrap the whole composed model in DDP);
- `create_optimizer` / `create_scheduler`: return the plugin's composites;
- `_clip_grad_norm` / `_get_grad_norm`: per-module or global clipping, combined norm;
- `log`: adds `grad_norm/<module>` and `lr/<module>`;
- `save_model`: one HF folder per module plus the root config;
- `_move_model_to_device`: leaves `empty_init` modules on the meta device for the plugin to fill.
"""

from __future__ import annotations

import inspect
import os

from transformers import Trainer

from .arguments import OmniTrainingArguments
from .plugin import OmniPlugin

# hook -> the parameter names we rely on (Trainer's private API changes between minor releases)
TRAINER_HOOKS: dict[str, tuple[str, ...]] = {
    "_prepare_for_training": ("self", "max_steps", "train_dataloader", "resume_from_checkpoint"),
    "create_optimizer": ("self", "model"),
    "create_scheduler": ("self", "num_training_steps", "optimizer"),
    "_clip_grad_norm": ("self", "model"),
    "_get_grad_norm": ("self", "model", "grad_norm"),
    "log": ("self", "logs", "start_time"),
    "save_model": ("self", "output_dir", "_internal_call"),
    "_move_model_to_device": ("self", "model", "device"),
}


def check_trainer_hooks(trainer_cls: type = Trainer) -> None:
    """Fail loudly, naming the method, when a Trainer hook we override disappears or changes signature."""
    for name, expected in TRAINER_HOOKS.items():
        method = getattr(trainer_cls, name, None)
        if method is None:
            raise RuntimeError(f"hf_omni: transformers.Trainer.{name} no longer exists; OmniTrainer overrides it")
        params = tuple(inspect.signature(method).parameters)
        if params != expected:
            raise RuntimeError(f"hf_omni: transformers.Trainer.{name} changed signature: {params} != {expected}; "
                               "OmniTrainer overrides it")


class OmniTrainer(Trainer):
    """Trainer for an `OmniModel`: per-module preparation, optimizers, schedulers, clipping and exports."""

    def __init__(self, model=None, args: OmniTrainingArguments | None = None, plugin: OmniPlugin | None = None,
                 **kwargs):
        check_trainer_hooks()
        if not isinstance(args, OmniTrainingArguments):
            raise TypeError("OmniTrainer needs OmniTrainingArguments (per-module settings live in its `modules:`)")
        if kwargs.get("optimizers", (None, None)) != (None, None) or kwargs.get("optimizer_cls_and_kwargs"):
            raise ValueError("optimizers=: OmniTrainer builds one optimizer and scheduler per trainable module from "
                             "`modules:` (learning_rate, optim, lr_scheduler_type, ...)")
        if kwargs.get("model_init") is not None:
            raise ValueError("model_init=: pass the composed model itself")
        self.plugin = plugin if plugin is not None else OmniPlugin.from_args(args)
        self.plugin.resolve(model)  # every argument error before any compute
        super().__init__(model=model, args=args, **kwargs)

    # -- setup ----------------------------------------------------------------------------------
    def _move_model_to_device(self, model, device):
        """Modules still on the meta device (`empty_init`) stay there: `OmniPlugin.prepare` fills them in place."""
        pending = getattr(model, "pending_weights", None)
        if not pending:
            return super()._move_model_to_device(model, device)
        for name, module in model.omni_modules().items():
            if name not in pending:
                module.to(device)

    def _prepare_for_training(self, max_steps, train_dataloader, resume_from_checkpoint):
        if self.plugin.model is None:
            _, self.optimizer, self.lr_scheduler = self.plugin.prepare(self.accelerator, self.model, max_steps)
        else:  # a second train() call: fresh optimizers and schedulers over the already prepared modules
            self.plugin.build_optimizers(max_steps)
            self.optimizer, self.lr_scheduler = self.plugin.optimizer, self.plugin.scheduler
        self.model_wrapped = self.model
        if resume_from_checkpoint is not None:
            self._load_optimizer_and_scheduler(resume_from_checkpoint)
        for attr in ("model", "optimizer", "lr_scheduler"):
            setattr(self.callback_handler, attr, getattr(self, attr))
        self.callback_handler.train_dataloader = train_dataloader
        return self.model, train_dataloader

    def create_optimizer(self, model=None):
        if self.plugin.optimizer is None:
            raise RuntimeError("OmniTrainer builds its optimizers in train() (OmniPlugin.prepare)")
        return self.plugin.optimizer

    def create_scheduler(self, num_training_steps: int, optimizer=None):
        if self.plugin.scheduler is None:
            raise RuntimeError("OmniTrainer builds its schedulers in train() (OmniPlugin.prepare)")
        return self.plugin.scheduler

    # -- the step -------------------------------------------------------------------------------
    def _clip_grad_norm(self, model):
        return self.plugin.clip_grad_norm_()

    def _get_grad_norm(self, model, grad_norm=None):
        # Trainer clips only when the top-level max_grad_norm > 0; per-module limits apply regardless
        return self.plugin.clip_grad_norm_() if grad_norm is None else grad_norm

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        if "loss" in logs and self.plugin.model is not None:
            logs = {**logs, **self.plugin.log_metrics()}
        super().log(logs, start_time)

    # -- saving ---------------------------------------------------------------------------------
    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """`output_dir/config.json` + `output_dir/<module>/` for every module, each loadable alone."""
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        if self.args.should_save:
            os.makedirs(output_dir, exist_ok=True)
        self.model.save_pretrained(output_dir, is_main_process=self.args.should_save,
                                   merge_lora=self.args.merge_lora_on_export)
