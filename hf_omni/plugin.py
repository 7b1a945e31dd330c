"""`OmniPlugin`: the Accelerate plugin that prepares each module of a composed model on its own terms.

For people who write their own Accelerate loop (OmniTrainer is a thin layer over it)::

    plugin = OmniPlugin.from_args(args)            # or OmniPlugin(modules={...}, defaults={...})
    model, optimizer, scheduler = plugin.prepare(accelerator, model, num_training_steps=1000)
    for batch in loader:                           # (plugin.agree_window(batches): a window's exchange at once)
        with plugin.no_sync() if not last_micro_step else contextlib.nullcontext():
            accelerator.backward(model(**batch).loss)
        plugin.clip_grad_norm_()
        optimizer.step(); scheduler.step(); optimizer.zero_grad()
    plugin.save_state("ckpt"); plugin.load_state("ckpt")

It resolves the arguments, hands each module to `parallel.driver` (tuning, wrapping), builds the optimizers
(`optim`), clips, reports per-module figures, and delegates checkpoints to `checkpoint.checkpointer.ModuleCheckpointer`.
"""

from __future__ import annotations

import os

import torch
from torch import nn

from .arguments.module import ModuleArguments
from .arguments.training import OmniTrainingArguments
from .checkpoint.checkpointer import ModuleCheckpointer
from .checkpoint.resume import resume_weights_folders
from .core.dist import agreed, checkpoint_group, default_group_timeout
from .core.errors import OmniArgumentError
from .core.refusals import RESOLVED, TUNED, refuse
from .metrics.module_bytes import log_bytes_table, module_bytes
from .metrics.profile import ModuleProfile
from .modeling import OmniModel
from .modules.ownership import check_ownership
from .modules.views import SlotViews
from .offline.serve import serve_from_caches
from .offline.window import agree_window, close_windows
from .optim.ema import attach_emas
from .optim.gradients import clip_grad_norms, fp16_scaler
from .optim.optimizers import ModuleOptimizers, ModuleSchedulers, build_optimizers
from .parallel.driver import Prepared, prepare_modules
from .tuning.modes import apply_training_modes


class OmniPlugin(SlotViews):
    """Per-module freezing / LoRA / wrapping / optimizer / scheduler / clipping / checkpoints for an `OmniModel`.

    What it decides about each module lives in the module's slot (`model.slots[name]`); after `prepare` these views
    of the slots: `module_args[name]` (resolved settings), `trainable`, `wrapped[name]` ("fsdp" | "ddp" | "none" |
    "offline"), `fsdp_plugins[name]` (one Accelerate `FullyShardedDataParallelPlugin` per FSDP-wrapped module;
    under `fsdp_scope: model` the one plugin of the composed model, keyed `"(model)"`), `meshes[name]`; and
    `optimizer` / `scheduler` (composites over the trainable modules' own), `grad_norms` (last step's), `profile`."""

    def __init__(self, modules: dict | None = None, defaults: dict | None = None, *, output_dir: str | None = None,
                 args: OmniTrainingArguments | None = None):
        if args is None:
            defaults = dict(defaults or {})
            for key in defaults:
                if key not in OmniTrainingArguments.__dataclass_fields__ or key == "modules":
                    raise OmniArgumentError(None, key, "unknown top-level key for OmniPlugin defaults")
            args = OmniTrainingArguments(output_dir=output_dir, modules=modules, **defaults)
        elif modules is not None or defaults is not None:
            raise ValueError("OmniPlugin: give either args= or modules= / defaults=, not both")
        else:
            output_dir = output_dir or args.output_dir
        self.args = args
        self.output_dir = output_dir  # a frozen module built in memory is written once under it (frozen/<module>/)
        self.optimizer: ModuleOptimizers | None = None
        self.scheduler: ModuleSchedulers | None = None
        self.model: OmniModel | None = None  # the model `resolve` saw
        self.prepared: Prepared | None = None
        self.checkpointer: ModuleCheckpointer | None = None
        self.scaler = None
        self.profile = ModuleProfile({}, "cpu")  # `time/<module>` (profile.py): hooked when optimizers are built

    @classmethod
    def from_args(cls, args: OmniTrainingArguments) -> "OmniPlugin":
        return cls(args=args)

    @property
    def is_prepared(self) -> bool:
        """`prepare` ran: modules wrapped and optimizers built."""
        return self.optimizer is not None

    @property
    def modules_prepared(self) -> bool:
        """`prepare_modules` ran (by `prepare`, or by OmniTrainer's `evaluate()` before `train()`)."""
        return self.prepared is not None

    def resolve(self, model: nn.Module) -> dict[str, ModuleArguments]:
        """Resolve every module's settings against `model` (unknown / missing modules are errors), then check them:
        the refusals each feature registered for resolved settings (`core.refusals`), before any compute."""
        if not isinstance(model, OmniModel):
            raise TypeError(f"OmniPlugin prepares an OmniModel, got {type(model).__name__}")
        check_ownership(model)
        for name, margs in self.args.resolve_modules(model.module_names).items():
            model.slots[name].args, model.slots[name].settings = margs, margs.strategy_settings()
        self.model = model
        if not any(m.trainable for m in self.module_args.values()):
            raise OmniArgumentError(None, "modules", "nothing is trainable: every module has trainable: false")
        refuse(RESOLVED, model, self.args)
        return self.module_args

    def offline_datasets(self, model: OmniModel, datasets: dict, collator, batch_size: int, device) -> dict:
        """`offline_modules`: each dataset (split name -> map-style dataset) served from caches of the offline
        modules' outputs, encoded first where none is valid; then each offline module is released to the meta
        device. Call before `prepare`. See `offline.serve.serve_from_caches`."""
        cache_dir = self.args.offline_cache_dir or os.path.join(self.output_dir or ".", "offline_cache")
        return serve_from_caches(model, datasets, cache_dir, self.args.offline_cache, collator, batch_size, device,
                                 self.output_dir, timeout_s=self.args.ddp_timeout)

    def prepare(self, accelerator, model: OmniModel, num_training_steps: int | None = None):
        """Freeze / LoRA / checkpoint / wrap each module in place (`prepare_modules`, unless done already), then
        build its optimizer and scheduler. Returns `(model, optimizer, scheduler)`; `model` is the same object."""
        if self.is_prepared:
            raise RuntimeError("OmniPlugin.prepare was already called; use one plugin per model")
        if not self.modules_prepared:
            self.prepare_modules(accelerator, model)
        elif model is not self.model:
            raise RuntimeError("OmniPlugin.prepare: the plugin prepared another model's modules")
        self.scaler = fp16_scaler(accelerator, model.slots)  # fp16: the Accelerator's GradScaler, shared
        self.build_optimizers(num_training_steps)
        log_bytes_table(self.module_bytes())  # once, on rank 0
        model.train()
        return model, self.optimizer, self.scheduler

    def prepare_modules(self, accelerator, model: OmniModel) -> OmniModel:
        """Every module in place as training will run it, without optimizers (evaluation before training: an
        `empty_init` module is sharded and read as it will be trained), in named steps: resolve -> check -> tune ->
        check -> the driver's (`parallel.driver`: plan, meshes, layouts, shard / replicate, precision)."""
        if self.modules_prepared:
            raise RuntimeError("OmniPlugin.prepare_modules was already called; use one plugin per model")
        self.resolve(model)
        if not apply_training_modes(model.slots):
            raise OmniArgumentError(None, "modules", "nothing is trainable: no module has a parameter that requires "
                                    "grad after freezing and LoRA")
        refuse(TUNED, model, self.args)
        default_group_timeout(self.args.ddp_timeout)
        checkpoint_group(self.args.ddp_timeout)  # hf_omni's side group, with ddp_timeout, before anything agrees
        self.prepared = model.prepared = prepare_modules(accelerator, model, fsdp_scope=self.args.fsdp_scope,
                                                         model_settings=self.args.fsdp_plugin,
                                                         timeout_s=self.args.ddp_timeout)
        self.checkpointer = ModuleCheckpointer(model, self.output_dir, self.args.save_async,
                                               verify=self.args.verify_checkpoint,
                                               show_progress=not self.args.disable_tqdm,
                                               timeout_s=self.args.ddp_timeout)
        return model

    def build_optimizers(self, num_training_steps: int | None) -> None:
        """One optimizer and one scheduler per trainable module (again on a second `train()`)."""
        self.optimizer, self.scheduler = build_optimizers(self.model, self.args, num_training_steps, self.scaler)
        self.profile.close()  # a second run: fresh hooks, counting the new optimizers' steps
        self.profile = ModuleProfile.for_args(self.model.slots, self.prepared.device, self.args)
        self.optimizer.before_step, self.optimizer.after_step = self.checkpointer.fence, [self.profile.stepped]
        attach_emas(self.model, self.optimizer)  # `ema`: shadows now, updated after each step that stepped

    def module_bytes(self) -> dict[str, dict]:  # parameters, gradients, optimizer state, masters (module_bytes.py)
        return module_bytes(self._slots(), self.optimizer)

    # -- the training step ----------------------------------------------------------------------
    def no_sync(self):
        """Gradient accumulation: no gradient sync in any module inside this context."""
        return self.prepared.no_sync()

    def agree_window(self, batches: list) -> bool:
        """One all-gather for the missing-modality exchange of a window's `batches`, in order (`offline.window`)."""
        return agree_window(self.model, batches)

    def clip_grad_norm_(self) -> torch.Tensor:
        """Clip per module (`grad_clip_scope: per_module`, each to its own `max_grad_norm`) or globally; returns the
        combined pre-clip norm sqrt(sum of the modules' squared norms). DTensor-aware."""
        limits = {name: self.module_args[name].max_grad_norm for name in self.trainable}
        global_limit = (self.args.max_grad_norm or 0.0) if self.args.grad_clip_scope == "global" else None
        norms, total = clip_grad_norms(self.optimizer, limits, global_limit, self.prepared.device)
        for name, norm in norms.items():
            self.model.slots[name].grad_norm = norm  # each slot keeps its own
        return total

    def log_metrics(self) -> dict[str, float]:
        """The last step's `grad_norm/<module>` (pre-clip) and `lr/<module>`, `time/<module>`: logging steps only."""
        logs = {f"grad_norm/{name}": float(norm) for name, norm in self.grad_norms.items()}
        if self.scheduler is not None:
            lrs = self.scheduler.stepped_lr or self.scheduler.last_lr_by_module()
            logs.update({f"lr/{name}": lr for name, lr in lrs.items()})
        logs.update(self.profile.logs())
        return logs

    # -- checkpoints (see checkpoint/) ----------------------------------------------------------
    def save_state(self, directory: str, step: int | None = None, write_marker: bool = True,
                   weights_only: bool = False) -> None:
        """Every rank: module folders (HF files + `state/` with DCP optimizer shards and the scheduler), the root
        `config.json`, then — after every rank finished every module — `hf_omni_checkpoint.json`, atomically.
        With `save_async`, tensors are copied and files written in the background (the next optimizer step waits
        for the copies: change parameters only through this plugin's optimizer until then, or call
        `wait_for_save()` first) and the marker waits for the next save or `wait_for_save()`. RNG and data
        position stay the loop's (e.g. `accelerator.save_state`)."""
        self.checkpointer.save(directory, self.optimizer, self.scheduler, step=step, write_marker=write_marker,
                               weights_only=weights_only)

    def wait_for_save(self) -> None:
        """Finish the save in flight (its files on every rank, then its marker)."""
        if self.checkpointer is not None:
            self.checkpointer.wait()

    def close(self) -> None:
        """The end of training: the save in flight finished and marked, async staging buffers released."""
        self.profile.close()  # its hooks removed
        if self.checkpointer is not None:
            self.checkpointer.close()
        if self.model is not None:
            close_windows(self.model)  # a problem kept since the last window's agreement: every rank raises it
            with agreed("the end of training", checkpoint_group()):  # one a boundary kept on the device
                problem = self.model.deferred_problem()
                if problem is not None:
                    raise ValueError(problem)

    def fill_from_checkpoint(self, model: OmniModel, directory: str) -> set[str]:
        """Before `prepare`: `empty_init` modules will be filled from the checkpoint instead of their initial
        weights. Returns them (`load_state` then skips their weights)."""
        return resume_weights_folders(model, directory)

    def load_state(self, directory: str, weights_loaded: set[str] = frozenset(), weights_only: bool = False) -> None:
        """Every rank: read back what `save_state` wrote (weights, optimizer shards resharded by DCP, schedulers);
        frozen modules from their recorded source. `weights_only`: the modules' tensors alone."""
        self.wait_for_save()
        self.checkpointer.load(directory, self.optimizer, self.scheduler, weights_loaded, weights_only)

