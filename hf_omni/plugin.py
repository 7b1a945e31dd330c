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

import contextlib

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
        self.output_dir = output_dir or args.output_dir
        self.module_args: dict[str, ModuleArguments] = {}
        self.fsdp_plugins: dict = {}
        self.wrapped: dict[str, str] = {}
        self.trainable: list[str] = []
        self.optimizer: ModuleOptimizers | None = None
        self.scheduler: ModuleSchedulers | None = None
        self.grad_norms: dict[str, torch.Tensor] = {}
        self.model: OmniModel | None = None
        self._params: dict[str, list[nn.Parameter]] = {}  # each trainable module's trainable parameters

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
