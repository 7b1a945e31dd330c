"""How each module of a composed model is prepared, as named steps in a fixed order (torchtitan style):

    freeze | LoRA -> activation checkpointing    (tuning.py, every module)
    plan: fsdp | ddp | none per module           (no process group: none everywhere)
    fill whole what is not sharded (empty_init) -> place -> wrap in place -> fill shards (empty_init)

Wrapping is in place: `model.<name>` keeps its class (a generated subclass) and its methods. The result, a
`WrappedModules`, is what the composed model needs at run time (eval-mode modules, `no_sync`).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
from torch import nn

from ..compat import fsdp_lazy_init_root
from ..dist import has_process_group, world_size
from ..module_arguments import FsdpSettings, ModuleArguments
from ..offline import is_released
from ..weights import fill_module
from . import ddp, fsdp, none
from .mesh import Meshes, mesh_shape
from .tuning import apply_training_mode


@dataclass
class WrappedModules:
    """What `prepare_modules` applied: per module "fsdp" | "ddp" | "none", the Accelerate FSDP plugins (keyed by
    module, or `fsdp.MODEL_SCOPE` for the one wrap of the composed model), the fully frozen modules (kept in eval
    mode), and the units whose gradient sync an accumulation window turns off."""

    wrapped: dict[str, str] = field(default_factory=dict)
    fsdp_plugins: dict = field(default_factory=dict)
    frozen: set[str] = field(default_factory=set)
    sync_units: list[tuple[nn.Module, str, bool]] = field(default_factory=list)  # (unit, strategy, keep_gathered)
    meshes: dict = field(default_factory=dict)  # module -> its DeviceMesh (`parallel: fsdp` modules)
    device: torch.device = torch.device("cpu")  # where the modules run (the accelerator's device)
    syncing: bool = True  # False inside an accumulation window's micro-steps before the last

    @contextlib.contextmanager
    def no_sync(self):
        """No gradient sync in any wrapped unit inside this context (gradient accumulation)."""
        self._set_sync(False)
        try:
            yield
        finally:
            self._set_sync(True)

    def _set_sync(self, enabled: bool) -> None:
        self.syncing = enabled
        for unit, strategy, keep_gathered in self.sync_units:
            if strategy == "fsdp":
                fsdp.set_gradient_sync(unit, enabled, keep_gathered)
            else:
                ddp.set_gradient_sync(unit, enabled)


def apply_training_modes(model: nn.Module, module_args: dict[str, ModuleArguments]) -> list[str]:
    """Freeze / LoRA / activation checkpointing of every module; returns the modules that still train."""
    return [name for name, margs in module_args.items() if apply_training_mode(getattr(model, name), margs)]


def plan_wrapping(module_args: dict[str, ModuleArguments], trainable: list[str], fsdp_scope: str) -> dict[str, str]:
    """No process group: everything runs unwrapped. Otherwise each trainable module as `parallel` says; a fully
    frozen module only when its own entry asks for `parallel: fsdp`; under `fsdp_scope: model`, all of them
    inside the one wrap of the composed model."""
    if not has_process_group():
        return {name: "none" for name in module_args}
    if fsdp_scope == "model":
        return {name: "fsdp" for name in module_args}
    return {name: margs.parallel if name in trainable or (margs.parallel_from_module and margs.parallel == "fsdp")
            else "none" for name, margs in module_args.items()}


def prepare_modules(accelerator, model, module_args: dict[str, ModuleArguments], trainable: list[str], *,
                    fsdp_scope: str, model_fsdp: FsdpSettings) -> WrappedModules:
    """Place, wrap and (for `empty_init` modules) fill every module; `trainable` from `apply_training_modes`."""
    device = accelerator.device
    plan = plan_wrapping(module_args, trainable, fsdp_scope)
    result = WrappedModules(wrapped=dict(plan), frozen=set(module_args) - set(trainable), device=device)
    shapes = {name: mesh_shape(name, module_args[name].parallelism, world_size()) for name in plan
              if plan[name] == "fsdp" and fsdp_scope == "module"}  # every mesh error before anything is placed
    if fsdp_scope == "model" and has_process_group() and module_args:  # the top-level parallelism (every module's)
        shapes[fsdp.MODEL_SCOPE] = mesh_shape(None, next(iter(module_args.values())).parallelism, world_size())
    meshes = Meshes(device.type)
    pending = dict(model.pending_weights)
    shard_later = {n: f for n, f in pending.items() if plan[n] == "fsdp" and fsdp_scope == "module"}
    # offline modules (`offline.release`): on the meta device for good, never placed, wrapped or filled
    released = {n for n in module_args if n not in pending and is_released(getattr(model, n))}
    for name in released:
        result.wrapped[name] = "offline"
    for name, folder in pending.items():  # empty_init, not sharded: filled whole
        if name not in shard_later:
            fill_module(getattr(model, name), folder, device, name)
    # placement + autocast; never DDP-wrapped (meta modules are placed by their filling below)
    model = accelerator.prepare_model(model, device_placement=not (shard_later or released), evaluation_mode=True)
    if shard_later or released:
        for name, module in model.omni_modules().items():
            if name not in shard_later and name not in released:
                module.to(device)
    if has_process_group():
        if fsdp_scope == "model":  # one wrap of the whole composed model, frozen modules included
            _wrap_fsdp(result, model, fsdp.MODEL_SCOPE, model_fsdp, device, lazy_init=True,
                       mesh=meshes.get(shapes[fsdp.MODEL_SCOPE]))
        else:
            for name, margs in module_args.items():
                if name not in released:
                    mesh = meshes.get(shapes[name]) if name in shapes else None
                    _wrap(result, getattr(model, name), name, plan[name], margs, device,
                          lazy_init=name not in shard_later, mesh=mesh)
    for name, folder in shard_later.items():  # sharded on meta, then each rank reads its own rows
        offload = module_args[name].fsdp_settings().cpu_offload  # FSDP2 keeps offloaded shards on the CPU
        fill_module(getattr(model, name), folder, torch.device("cpu") if offload else device, name)
        fsdp_lazy_init_root(getattr(model, name))
    model.pending_weights = {}
    return result


def _wrap(result: WrappedModules, module: nn.Module, name: str, strategy: str, margs: ModuleArguments,
          device: torch.device, lazy_init: bool, mesh=None) -> None:
    if strategy == "fsdp":
        _wrap_fsdp(result, module, name, margs.fsdp_settings(), device, lazy_init, mesh)
    elif strategy == "ddp":
        ddp.apply(module, device, margs.ddp_kwargs())
        result.sync_units.append((module, "ddp", False))
    else:
        none.apply(module)


def _wrap_fsdp(result: WrappedModules, module: nn.Module, name: str, settings: FsdpSettings, device: torch.device,
               lazy_init: bool, mesh=None) -> None:
    plugin = result.fsdp_plugins[name] = fsdp.build_plugin(module, name, settings)
    fsdp.apply(module, name, plugin, device, lazy_init=lazy_init, mesh=mesh)
    if mesh is not None:
        result.meshes[name] = mesh
    result.sync_units.append((module, "fsdp", not settings.reshard_after_backward))
