"""`OmniTrainer`: `transformers.Trainer` over an `OmniPlugin`. Trainer's loop runs unchanged; the hooks it overrides
are listed, with the parameters relied on, in `hooks.TRAINER_METHODS` (checked against the installed Trainer):

- preparing: `_prepare_for_training` (the plugin wraps each module in place and builds its optimizer and
  scheduler), `create_optimizer` / `create_scheduler` (the plugin's composites), `_move_model_to_device` (meta
  modules stay for the plugin to fill), `evaluate` / `predict` (before `train()`: the modules prepared first,
  `evaluation.py`);
- the step: `get_batch_samples` / `training_step` (the exchange once a window: `step_window.py`), `compute_loss`
  (label smoothing inside the modules), `_clip_grad_norm` / `_get_grad_norm`, `log`;
- checkpoints (`hf_omni.checkpoint`): `train` (the newest *complete* checkpoint), `_save_checkpoint` (the marker
  after Trainer's own state), `_load_from_checkpoint` / `_load_optimizer_and_scheduler` / `_load_scaler` (the plugin
  reads them, never a pickle), `_save_rng_state` / `_load_rng_state` (JSON, one per rank), `_load_best_model`;
- exports and the Hub: `save_model`, `push_to_hub`, `_push_from_checkpoint` (`hub.py`); the data (`data.py`)."""

from __future__ import annotations

import os

from transformers import Trainer
from transformers.utils import can_return_loss, find_labels

from ..arguments.training import OmniTrainingArguments
from ..checkpoint import contents
from ..checkpoint.resume import check_shared
from ..checkpoint.rng import restore_rng_state, save_rng_state
from ..hub.cards import write_summary
from ..offline.serve import ENCODE_ONLY
from ..plugin import OmniPlugin
from . import label_smoothing, profile_steps
from .data import TrainingDataMixin
from .evaluation import EvaluationMixin
from .hooks import check_trainer_hooks
from .hub import HubPushMixin, check_hub_links
from .loss_parts import LossPartsMixin
from .step_window import StepWindowMixin


class OmniTrainer(StepWindowMixin, LossPartsMixin, TrainingDataMixin, EvaluationMixin, HubPushMixin, Trainer):
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
        check_hub_links(args, model)
        super().__init__(model=model, args=args, **kwargs)
        self.add_callback(profile_steps.TimedSteps(self.plugin))  # `time/<module>`: logging steps only
        owner = model.forward_class()  # Trainer read the composed class; an adopted model's forward is the
        if args.label_names is None:    # released class's (or its step's), set on the instance
            self.label_names = find_labels(owner)
        self.can_return_loss = can_return_loss(owner)
        self._init_hub()
        for module in model.omni_modules().values():  # Trainer sets `use_cache` on its one model's config
            if hasattr(getattr(module, "config", None), "use_cache"):  # a module of another format may have none
                module.config.use_cache = args.use_cache
        self.smoothed_losses = label_smoothing.install(model, args.label_smoothing_factor) \
            if self.label_smoother is not None else []  # smoothing inside the modules that compute the loss
        self.label_smoother = None
        if args.neftune_noise_alpha is not None:
            model.get_input_embeddings()  # NEFTune's embeddings: ambiguous or missing ones refused now

    # -- checkpoints ----------------------------------------------------------------------------
    def train(self, resume_from_checkpoint=None, trial=None, ignore_keys_for_eval=None, **kwargs):
        """`resume_from_checkpoint=True`: the newest checkpoint with its marker; either is checked before any load."""
        if resume_from_checkpoint is True:
            resume_from_checkpoint = contents.newest_complete_checkpoint(self.args.output_dir)
            if resume_from_checkpoint is None:
                raise ValueError(f"resume_from_checkpoint=True: no complete checkpoint in {self.args.output_dir}")
        if isinstance(resume_from_checkpoint, (str, os.PathLike)):
            check_shared(str(resume_from_checkpoint), self.args.ddp_timeout)  # each rank stats its share
        if self.plugin.offline and not self.plugin.modules_prepared:
            self._serve_offline()
        if os.environ.get(ENCODE_ONLY) == "1":  # `hf-omni encode`: the caches are built; stop here
            if not self.plugin.offline:
                raise ValueError("hf-omni encode: this run's arguments name no offline_modules: nothing to encode")
            if self.is_world_process_zero():
                print(f"hf-omni encode: offline caches of {sorted(self.plugin.offline)} ready")
            raise SystemExit(0)
        output = super().train(resume_from_checkpoint=resume_from_checkpoint, trial=trial,
                               ignore_keys_for_eval=ignore_keys_for_eval, **kwargs)
        self.plugin.close()  # an async save still in flight gets its marker (and its push); buffers released
        self.hub_push.finish(self.plugin.checkpointer.group)  # the run's last push done; its error on every rank
        return output

    def _load_from_checkpoint(self, resume_from_checkpoint, model=None):
        """Nothing here: Trainer calls this before preparing; the plugin reads the modules once they are wrapped."""

    def _load_optimizer_and_scheduler(self, checkpoint):
        """Nothing here: the plugin loaded them (never Trainer's pickled `optimizer.pt` / `scheduler.pt`)."""

    def _load_scaler(self, checkpoint):
        """Nothing here: the plugin loaded `scaler.json` (never a pickled `scaler.pt`)."""

    def _save_checkpoint(self, model, trial):
        from transformers.trainer_callback import ExportableState
        from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

        self.store_flos()
        run_dir = self._get_output_dir(trial=trial)
        output_dir = os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")
        self.plugin.save_state(output_dir, step=self.state.global_step, write_marker=False,
                               weights_only=self.args.save_only_model)
        if not self.args.save_only_model:
            self._save_rng_state(output_dir)
        if self.state.best_global_step:
            best = os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{self.state.best_global_step}")
            if os.path.exists(best):
                self.state.best_model_checkpoint = best
        if self.args.should_save:
            for cb in [cb for cb in self.callback_handler.callbacks + [self.control]
                       if isinstance(cb, ExportableState)]:
                name, cb_state = cb.__class__.__name__, cb.state()
                if isinstance(self.state.stateful_callbacks[name], list):
                    self.state.stateful_callbacks[name].append(cb_state)
                else:
                    self.state.stateful_callbacks[name] = cb_state
            self.state.save_to_json(os.path.join(output_dir, "trainer_state.json"))
            write_summary(output_dir, self.plugin.module_args, self.state.log_history, self.state.global_step)
        if not self.args.save_async:
            self.plugin.wait_for_save()  # the marker, after Trainer's own state
        if self.args.should_save:
            contents.rotate(run_dir, self.args.save_total_limit, self.state.best_model_checkpoint,
                                    busy=self.hub_push.busy(), bases=self.plugin.checkpointer.base_folders())

    def _load_best_model(self):
        """`load_best_model_at_end`: every module's weights from the best checkpoint (after any save in flight)."""
        self.plugin.load_state(self.state.best_model_checkpoint, weights_only=True)

    def _save_rng_state(self, output_dir):
        """Each rank's RNG state as JSON (`rng.py`): a resume reads it back without unpickling anything."""
        save_rng_state(output_dir, self.args.process_index)

    def _load_rng_state(self, checkpoint):
        """Each rank restores its own RNG file; at another world size, a rank without one gets a derived state."""
        if checkpoint is not None:
            restore_rng_state(checkpoint, self.args.process_index)

    def _move_model_to_device(self, model, device):
        """Modules still on the meta device (`empty_init`) stay there: `OmniPlugin.prepare` fills them in place."""
        if not any(slot.is_pending or slot.is_offline for slot in model.slots.values()):
            return super()._move_model_to_device(model, device)
        for slot in model.slots.values():
            if not slot.is_pending and not slot.is_offline:
                slot.module.to(device)

    def _prepare_for_training(self, max_steps, train_dataloader, resume_from_checkpoint):
        filled = set()
        if not self.plugin.is_prepared:
            if resume_from_checkpoint is not None and not self.plugin.modules_prepared:  # empty_init: straight to
                filled = self.plugin.fill_from_checkpoint(self.model, resume_from_checkpoint)  # the checkpoint
            _, self.optimizer, self.lr_scheduler = self.plugin.prepare(self.accelerator, self.model, max_steps)
        else:  # a second train() call: fresh optimizers and schedulers over the already prepared modules
            self.plugin.build_optimizers(max_steps)
            self.optimizer, self.lr_scheduler = self.plugin.optimizer, self.plugin.scheduler
        self.model_wrapped = self.model
        self.plugin.checkpointer.on_marked = self._push_from_checkpoint  # hub_strategy: after each marker
        if resume_from_checkpoint is not None:
            self.plugin.load_state(resume_from_checkpoint, weights_loaded=filled)
        for attr in ("model", "optimizer", "lr_scheduler"):  # what callbacks are handed
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
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if not self.smoothed_losses or "labels" not in inputs:
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        before = label_smoothing.calls(self.smoothed_losses)
        out = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        label_smoothing.check(self.smoothed_losses, before)
        return out

    def _clip_grad_norm(self, model):
        return self.plugin.clip_grad_norm_()

    def _get_grad_norm(self, model, grad_norm=None):
        # Trainer clips only when the top-level max_grad_norm > 0; per-module limits apply regardless
        return self.plugin.clip_grad_norm_() if grad_norm is None else grad_norm

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        if "loss" in logs and self.plugin.model is not None:
            logs = {**logs, **self.loss_part_logs(), **self.plugin.log_metrics()}
        super().log(logs, start_time)

    # -- saving ---------------------------------------------------------------------------------
    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """`output_dir/config.json` + `output_dir/<module>/` for every module, each loadable alone."""
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        if self.args.should_save:
            os.makedirs(output_dir, exist_ok=True)
        self.model.save_pretrained(output_dir, is_main_process=self.args.should_save,
                                   merge_lora=self.args.merge_lora_on_export)
        if self.args.should_save and self.plugin.module_args:
            write_summary(output_dir, self.plugin.module_args, self.state.log_history, self.state.global_step)
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)
