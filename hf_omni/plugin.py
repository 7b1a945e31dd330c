"""`OmniPlugin`: the Accelerate plugin that prepares each module of a composed model on its own terms.

For people who write their own Accelerate loop (OmniTrainer is a thin layer over it)::

    plugin = OmniPlugin.from_args(args)            # or OmniPlugin(modules={...}, defaults={...})
    model, optimizer, scheduler = plugin.prepare(accelerator, model, num_training_steps=1000)
    for batch in loader:
        with plugin.no_sync() if not last_micro_step else contextlib.nullcontext():
            accelerator.backward(model(**batch).loss)
        plugin.clip_grad_norm_()
        optimizer.step(); scheduler.step(); optimizer.zero_grad()
"""

from __future__ import annotations

import atexit
import contextlib
import os

import torch
from torch import nn

from .arguments import ModuleArguments, OmniArgumentError, OmniTrainingArguments
from .empty_init import fill_module
from .fsdp import build_fsdp_plugin, lazy_init_root, shard_module
from .modeling import OmniModel
from .optim import ModuleOptimizers, ModuleSchedulers, build_module_optimizer, build_module_scheduler
from .parallelize import apply_activation_checkpointing, apply_lora, freeze, has_process_group, wrap_module


MODEL_SCOPE = "(model)"  # the key of the one plugin under fsdp_scope: model


class OmniPlugin:
    """Per-module freezing / LoRA / wrapping / optimizer / scheduler / clipping for an `OmniModel`.

    After `prepare`: `module_args[name]` (resolved settings), `fsdp_plugins[name]` (one Accelerate
    `FullyShardedDataParallelPlugin` per FSDP-wrapped module; under `fsdp_scope: model` the one plugin of the
    composed model, keyed `"(model)"`), `wrapped[name]` ("fsdp" | "ddp" | "none"),
    `optimizer` / `scheduler` (composites over the trainable modules' own), `grad_norms` (last step's).
    """

    def __init__(self, modules: dict | None = None, defaults: dict | None = None, *, output_dir: str | None = None,
                 args: OmniTrainingArguments | None = None):
        constructed_here = args is None
        if args is None:
            defaults = dict(defaults or {})
            known = set(OmniTrainingArguments.__dataclass_fields__)
            for key in defaults:
                if key not in known or key == "modules":
                    raise OmniArgumentError(None, key, "unknown top-level key for OmniPlugin defaults")
            args = OmniTrainingArguments(output_dir=output_dir, modules=modules, **defaults)
        elif modules is not None or defaults is not None:
            raise ValueError("OmniPlugin: give either args= or modules= / defaults=, not both")
        self.args = args
        # where a frozen module built in memory is written once (frozen/<module>/): the Trainer's output_dir, or
        # the one given here; OmniPlugin(modules=..., defaults=...) without one has none
        self.output_dir = output_dir or (args.output_dir if not constructed_here else None)
        self.module_args: dict[str, ModuleArguments] = {}
        self.fsdp_plugins: dict = {}
        self.wrapped: dict[str, str] = {}
        self.trainable: list[str] = []
        self.optimizer: ModuleOptimizers | None = None
        self.scheduler: ModuleSchedulers | None = None
        self.grad_norms: dict[str, torch.Tensor] = {}
        self.model: OmniModel | None = None
        self._params: dict[str, list[nn.Parameter]] = {}  # each trainable module's trainable parameters
        self._pending_save: tuple | None = None  # (directory, step, DCP futures) of a save without its marker
        self._exit_hook = False
        self._executor = None
        self._stagers: dict = {}  # module -> DCP stager reused by async saves

    @classmethod
    def from_args(cls, args: OmniTrainingArguments) -> "OmniPlugin":
        return cls(args=args)

    # -- validation against the model -----------------------------------------------------------
    def resolve(self, model: nn.Module) -> dict[str, ModuleArguments]:
        """Resolve every module's settings against `model` (unknown / missing modules are errors)."""
        if not isinstance(model, OmniModel):
            raise TypeError(f"OmniPlugin prepares an OmniModel, got {type(model).__name__}")
        self.module_args = self.args.resolve_modules(model.module_names)
        if not any(m.trainable for m in self.module_args.values()):
            raise OmniArgumentError(None, "modules", "nothing is trainable: every module has trainable: false")
        return self.module_args

    # -- prepare --------------------------------------------------------------------------------
    def prepare(self, accelerator, model: OmniModel, num_training_steps: int | None = None):
        """Freeze / LoRA / checkpoint / wrap each module in place, then build its optimizer and scheduler.
        Returns `(model, optimizer, scheduler)`; `model` is the same object."""
        if self.model is not None:
            raise RuntimeError("OmniPlugin.prepare was already called; use one plugin per model")
        self.resolve(model)
        self._set_training_modes(model)
        device = accelerator.device
        plan = self._plan_wrapping(model)
        shard_later = {n: f for n, f in model.pending_weights.items() if plan[n] == "fsdp" and
                       self.args.fsdp_scope == "module"}
        for name, folder in model.pending_weights.items():  # empty_init, not sharded: filled whole
            if name not in shard_later:
                fill_module(getattr(model, name), folder, device)
        # placement + autocast; never DDP-wrapped (meta modules are placed by their filling below)
        model = accelerator.prepare_model(model, device_placement=not shard_later, evaluation_mode=True)
        if shard_later:
            for name, module in model.omni_modules().items():
                if name not in shard_later:
                    module.to(device)
        self._wrap_modules(model, device, plan, empty=set(shard_later))
        for name, folder in shard_later.items():  # sharded on meta, then each rank reads its own rows
            fill_module(getattr(model, name), folder, device)
            lazy_init_root(getattr(model, name))
        model.pending_weights = {}
        self.model = model
        self._params = {n: [p for p in getattr(model, n).parameters() if p.requires_grad] for n in self.trainable}
        self.build_optimizers(num_training_steps)
        model.train()
        return model, self.optimizer, self.scheduler

    def _set_training_modes(self, model: OmniModel) -> None:
        for name, margs in self.module_args.items():
            module = getattr(model, name)
            if margs.trainable and margs.lora:
                freeze(module)
                if not apply_lora(module, margs):
                    margs.trainable = False
            elif not margs.trainable:
                freeze(module)
            if margs.trainable and not any(p.requires_grad for p in module.parameters()):
                margs.trainable = False  # nothing left to train in it: treat as fully frozen
            if margs.trainable and margs.activation_checkpointing:
                apply_activation_checkpointing(module, margs)
        self.trainable = [n for n, m in self.module_args.items() if m.trainable]
        if not self.trainable:
            raise OmniArgumentError(None, "modules", "nothing is trainable: no module has a parameter that requires "
                                    "grad after freezing and LoRA")
        model.eval_modules = {n for n, m in self.module_args.items() if not m.trainable}

    def _plan_wrapping(self, model: OmniModel) -> dict[str, str]:
        """No process group: everything runs unwrapped. Otherwise each trainable module as `parallel` says;
        a fully frozen module only when its own entry asks for `parallel: fsdp`; under `fsdp_scope: model`, all
        of them inside the one wrap of the composed model."""
        if not has_process_group():
            return {name: "none" for name in self.module_args}
        if self.args.fsdp_scope == "model":
            return {name: "fsdp" for name in self.module_args}
        return {name: margs.parallel if (margs.trainable or (margs.parallel_from_module and margs.parallel == "fsdp"))
                else "none" for name, margs in self.module_args.items()}

    def _wrap_modules(self, model: OmniModel, device: torch.device, plan: dict[str, str], empty: set[str]) -> None:
        if not has_process_group():
            self.wrapped = dict(plan)
            return
        if self.args.fsdp_scope == "model":  # one wrap of the whole composed model, frozen modules included
            margs = ModuleArguments(name=MODEL_SCOPE, fsdp_plugin=dict(self.args.fsdp_plugin or {}))
            plugin = self.fsdp_plugins[MODEL_SCOPE] = build_fsdp_plugin(model, margs)
            shard_module(model, plugin, device)
            self.wrapped = dict(plan)
            model.gather_across_accumulation = {MODEL_SCOPE} if not plugin.reshard_after_backward else set()
            return
        for name, margs in self.module_args.items():
            wants = plan[name]
            plugin = None
            if wants == "fsdp":
                plugin = self.fsdp_plugins[name] = build_fsdp_plugin(getattr(model, name), margs)
                if not plugin.reshard_after_backward:
                    model.gather_across_accumulation.add(name)
            self.wrapped[name] = wrap_module(getattr(model, name), wants, device, plugin, lazy_init=name not in empty)

    def build_optimizers(self, num_training_steps: int | None) -> None:
        """One optimizer and one scheduler per trainable module (again on a second `train()`)."""
        optimizers, schedulers = {}, {}
        for name in self.trainable:
            margs = self.module_args[name]
            optimizers[name] = build_module_optimizer(getattr(self.model, name), margs, self.args)
            try:
                schedulers[name] = build_module_scheduler(optimizers[name], margs, num_training_steps)
            except ValueError as err:
                raise OmniArgumentError(name, "lr_scheduler_type", f"{err} (pass num_training_steps to prepare)") \
                    from None
        self.optimizer, self.scheduler = ModuleOptimizers(optimizers), ModuleSchedulers(schedulers)

    # -- the training step ----------------------------------------------------------------------
    @contextlib.contextmanager
    def no_sync(self):
        """Gradient accumulation: no gradient sync in any module inside this context."""
        with self.model.no_sync():
            yield

    def clip_grad_norm_(self) -> torch.Tensor:
        """Clip per module (`grad_clip_scope: per_module`, each to its own `max_grad_norm`) or globally; returns the
        combined pre-clip norm sqrt(sum of the modules' squared norms). DTensor-aware."""
        from torch.nn.utils import clip_grads_with_norm_

        grads_by_module = {name: [p for p in params if p.grad is not None] for name, params in self._params.items()}
        self.grad_norms = {name: module_grad_norm(params) for name, params in grads_by_module.items()}
        total = torch.linalg.vector_norm(torch.stack([n.float() for n in self.grad_norms.values()]))
        if self.args.grad_clip_scope == "global":
            if self.args.max_grad_norm and self.args.max_grad_norm > 0:
                for params in grads_by_module.values():
                    if params:
                        clip_grads_with_norm_(params, self.args.max_grad_norm, total)
        else:
            for name, params in grads_by_module.items():
                max_norm = self.module_args[name].max_grad_norm
                if params and max_norm and max_norm > 0:
                    clip_grads_with_norm_(params, max_norm, self.grad_norms[name])
        return total

    # -- checkpoints ----------------------------------------------------------------------------
    def save_state(self, directory: str, step: int | None = None, write_marker: bool = True) -> None:
        """Every rank: module folders (HF files + `state/` with DCP optimizer shards and the scheduler), the root
        `config.json`, then — after every rank finished every module — `hf_omni_checkpoint.json`, atomically.
        With `save_async`, DCP writes in the background and the marker waits for the next save or
        `wait_for_save()`. RNG and data position stay the loop's (e.g. `accelerator.save_state`)."""
        from .checkpoint import MARKER, _fsync_dir, _rank, barrier, make_stager, save_optimizer_state
        from .export import save_module

        self.wait_for_save()
        main = _rank() == 0
        if main:
            os.makedirs(directory, exist_ok=True)
            stale = os.path.join(directory, MARKER)
            if os.path.exists(stale):  # a re-save into this folder: incomplete until the new marker is written
                os.remove(stale)
                _fsync_dir(directory)
        barrier()
        self._write_frozen_sources()
        futures = []
        for name in self.trainable:
            module = getattr(self.model, name)
            folder = os.path.join(directory, self.model.config.module_entry(name)["subfolder"])
            files = save_module(module, folder, self.model.processors.get(name), is_main_process=main,
                                executor=self._writer() if self.args.save_async else None)
            futures += [files] if files is not None else []
            stager = self._stagers.setdefault(name, make_stager()) if self.args.save_async else None
            future = save_optimizer_state(module, self.optimizer.optimizers[name], self.scheduler.schedulers[name],
                                          folder, stager=stager)
            futures += [future] if future is not None else []
        if main:
            self.model.write_config(directory)
        self._pending_save = (directory, step, futures)
        if futures and not self._exit_hook:  # process exit waits for shards still being written
            atexit.register(lambda: [f.result() for f in (self._pending_save or (None, None, []))[2]])
            self._exit_hook = True
        if write_marker and not self.args.save_async:
            self.wait_for_save()

    def _writer(self):
        """The background thread that writes module files during an async save."""
        if self._executor is None:
            from concurrent.futures import ThreadPoolExecutor

            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hf_omni_save")
        return self._executor

    def wait_for_save(self) -> None:
        """Finish the save in flight: wait for its shards on every rank, then write its marker (rank 0)."""
        from .checkpoint import _rank, barrier, marker_info, write_marker

        if self._pending_save is None:
            return
        directory, step, futures = self._pending_save
        self._pending_save = None
        for future in futures:
            future.result()
        barrier()
        if _rank() == 0:
            write_marker(directory, marker_info(directory, step, list(self.trainable)))
        barrier()

    def _write_frozen_sources(self) -> None:
        """A fully frozen module with no source (built in memory) is written once to <output_dir>/frozen/<module>/,
        which becomes its recorded source."""
        from .checkpoint import _rank
        from .export import save_module

        for name in self.module_args:
            entry = self.model.config.module_entry(name)
            if name in self.trainable or entry.get("source"):
                continue
            if not self.output_dir:
                raise ValueError(f"module {name!r} is frozen and was built in memory: saving it needs an output_dir "
                                 "(args.output_dir, or OmniPlugin(output_dir=...))")
            folder = os.path.abspath(os.path.join(self.output_dir, "frozen", name))
            save_module(getattr(self.model, name), folder, self.model.processors.get(name),
                        is_main_process=_rank() == 0)
            entry["source"] = folder

    def fill_from_checkpoint(self, model: OmniModel, directory: str) -> set[str]:
        """Before `prepare`: modules still on the meta device (`empty_init`) will be filled from the checkpoint
        (trainable ones) or their recorded source (frozen ones) instead of their initial weights. Returns them."""
        from .config import OmniConfig

        if not model.pending_weights:
            return set()
        config = OmniConfig.from_pretrained(directory)
        filled = set()
        for name in list(model.pending_weights):
            entry = config.module_entry(name)
            folder = os.path.join(directory, entry["subfolder"])
            if not os.path.isfile(os.path.join(folder, "config.json")):
                folder = entry.get("source")
            if folder and os.path.isdir(folder):
                model.pending_weights[name] = folder
                filled.add(name)
        return filled

    def check_state(self, directory: str) -> dict:
        """Every check of a checkpoint against this model, before anything is loaded (names the module and
        parameter that differ)."""
        from .checkpoint import check_complete
        from .config import OmniConfig

        marker = check_complete(directory)
        saved, ours = set(marker["modules"]), set(self.trainable)
        if saved != ours:
            raise ValueError(f"checkpoint {directory} holds trainable modules {sorted(saved)}, this model trains "
                             f"{sorted(ours)} (missing: {sorted(ours - saved)}, extra: {sorted(saved - ours)})")
        config = OmniConfig.from_pretrained(directory)
        if config.module_names != self.model.module_names:
            raise ValueError(f"checkpoint {directory} has modules {config.module_names}, the model "
                             f"{self.model.module_names}")
        return marker

    def load_state(self, directory: str, weights_loaded: set[str] = frozenset()) -> None:
        """Every rank: read back what `save_state` wrote — each trainable module's weights (its own rows of a
        sharded one), optimizer shards (resharded by DCP at another world size) and scheduler; frozen modules
        from their recorded source."""
        from .checkpoint import load_optimizer_state
        from .config import OmniConfig
        from .empty_init import read_into

        self.check_state(directory)
        config = OmniConfig.from_pretrained(directory)
        sources = {}
        for name in self.module_args:
            entry = config.module_entry(name)
            sources[name] = os.path.join(directory, entry["subfolder"]) if name in self.trainable else entry["source"]
            if not sources[name] or not os.path.isdir(sources[name]):
                raise ValueError(f"checkpoint {directory}: module {name!r} has no weights folder ({sources[name]})")
        for name, folder in sources.items():  # shapes / dtypes of every module first: nothing half-loaded
            if name not in weights_loaded:
                read_into(getattr(self.model, name), folder, strict=True, module_name=name, dry_run=True)
        for name, folder in sources.items():
            if name not in weights_loaded:
                read_into(getattr(self.model, name), folder, strict=True, module_name=name)
            if not self.model.config.module_entry(name).get("source"):
                self.model.config.module_entry(name)["source"] = config.module_entry(name).get("source")
        for name in self.trainable:
            load_optimizer_state(getattr(self.model, name), self.optimizer.optimizers[name],
                                 self.scheduler.schedulers[name], sources[name])

    def log_metrics(self) -> dict[str, float]:
        """`grad_norm/<module>` (pre-clip) and `lr/<module>` (the rate it used) of the last optimizer step."""
        logs = {f"grad_norm/{name}": float(norm) for name, norm in self.grad_norms.items()}
        if self.scheduler is not None:
            lrs = self.scheduler.stepped_lr or self.scheduler.last_lr_by_module()
            logs.update({f"lr/{name}": lr for name, lr in lrs.items()})
        return logs


def module_grad_norm(params: list[nn.Parameter]) -> torch.Tensor:
    """L2 norm of the module's gradients; for sharded (DTensor) gradients the full norm over all ranks."""
    from torch.nn.utils import get_total_norm

    if not params:
        return torch.zeros(())
    norm = get_total_norm([p.grad for p in params])
    if hasattr(norm, "full_tensor"):
        norm = norm.full_tensor()
    return norm
