"""How each module of a composed model is prepared, as named steps in a fixed order (torchtitan style):

    freeze | LoRA -> activation checkpointing    (tuning.py, every module)
    plan: a strategy name per module             (no process group: none everywhere)
    master dtype of what trains                  (modules/precision.py: fp32 masters under bf16 / fp16 compute)
    read in stripes what is not sharded (empty_init) -> place -> apply each strategy in place -> read shards
    (empty_init) -> cast the masters of loaded modules now sharded, on each rank's shares -> each sharding
    strategy's lazy init

A module loaded whole and then sharded gets its fp32 masters after sharding: each rank allocates 1 / world of them
(P / world, P the module's fp32 bytes) where a cast before would allocate the whole P on every rank. Modules that
are not sharded (ddp, none) hold a whole copy anyway and are cast first; `empty_init` modules are cast on the meta
device (no memory), so their files are read straight into the masters.

Every refusal that needs the modules (a mesh that does not fit the world, a layout a module cannot take: no
tensor-parallel plan) comes before anything is placed or wrapped.

Each module's slot records what was applied (`ModuleSlot.wrapped(strategy)`); `Prepared` is what the composed model
needs at run time (the device, whether gradients sync now, `no_sync` over the strategies that sync).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch

from ..compat import keep_output_recording
from ..dist import has_process_group, world_size
from ..modules.precision import apply_master_dtype, cast_masters, run_compute_dtype
from ..modules.slot import ModuleSlot
from ..modules.weights import fill_module, move_buffers
from ..tuning.modes import apply_training_mode
from .layouts import layouts_for
from .mesh import Meshes, dim_names, mesh_shape
from .nesting import apply_order
from .strategy import MODEL_SCOPE, STRATEGIES, Strategy


@dataclass
class Prepared:
    """The composed model at run time: where its modules run, and whether gradients sync now (False inside an
    accumulation window's micro-steps before the last)."""

    device: torch.device = torch.device("cpu")
    strategies: list[Strategy] = field(default_factory=list)  # the ones that sync gradients
    syncing: bool = True

    @contextlib.contextmanager
    def no_sync(self):
        """No gradient sync in any module inside this context (gradient accumulation)."""
        self._set_sync(False)
        try:
            yield
        finally:
            self._set_sync(True)

    def _set_sync(self, enabled: bool) -> None:
        self.syncing = enabled
        for strategy in self.strategies:
            strategy.set_gradient_sync(enabled)


def apply_training_modes(slots: dict[str, ModuleSlot]) -> list[str]:
    """Freeze / LoRA / activation checkpointing of every module; returns the modules that still train."""
    for slot in slots.values():
        slot.trains = apply_training_mode(slot.module, slot.args)
    return [name for name, slot in slots.items() if slot.trains]


def plan(slot: ModuleSlot, fsdp_scope: str) -> str:
    """No process group: every module runs as it is. Otherwise a trainable module as its `parallel` says; a fully
    frozen one only when its own entry asks for a strategy that shards (`parallel: fsdp`, ...); under
    `fsdp_scope: model`, all of them inside the one wrap of the composed model."""
    if not has_process_group():
        return "none"
    if fsdp_scope == "model":
        return "fsdp"
    margs = slot.args
    return margs.parallel if slot.trains or (margs.parallel_from_module and margs.strategy.shards) else "none"


def prepare_modules(accelerator, model, *, fsdp_scope: str, model_settings: dict | None = None,
                    timeout_s: float | None = None) -> Prepared:
    """Place, wrap and (for `empty_init` modules) read every module that is not offline; each slot ends wrapped.
    `model_settings`: the top-level `fsdp_plugin` (`fsdp_scope: model`: the one wrap of the composed model);
    `timeout_s`: the timeout of the groups the modules' meshes make (`ddp_timeout`)."""
    device = accelerator.device
    model.sync_parts()  # an adopted model: submodules PEFT replaced, into the released model
    live = [slot for slot in model.slots.values() if not slot.is_released]  # offline: on meta for good
    run_dtype = run_compute_dtype(accelerator)
    kinds = {slot.name: plan(slot, fsdp_scope) for slot in live}
    scoped = fsdp_scope == "model" and has_process_group()
    sharded = {slot.name for slot in live  # loaded whole, then sharded: masters cast on each rank's shares only
               if not slot.is_pending and STRATEGIES["fsdp" if scoped else kinds[slot.name]].shards}
    for slot in live:  # the others before anything is read, placed or wrapped (on the meta device: no memory)
        slot.precision = apply_master_dtype(slot, run_dtype, cast=slot.name not in sharded)
    cast_later = {slot.name for slot in live if slot.name in sharded and slot.precision.masters}
    shapes = {slot.name: mesh_shape(slot.name, slot.args.parallelism, world_size()) for slot in live
              if STRATEGIES[kinds[slot.name]].takes_mesh and not scoped}  # every mesh error before anything is placed
    for slot in live:  # every layout's refusal too (a module without a tensor-parallel plan, ...)
        layouts = layouts_for(slot.name, slot.args.parallelism) if slot.name in shapes else []
        for layout in layouts:
            layout.check(slot.module)
    if scoped and live:  # the top-level parallelism (every module's)
        shapes[MODEL_SCOPE] = mesh_shape(None, live[0].args.parallelism, world_size())
    meshes = Meshes(device.type, timeout_s)
    shard_later = {slot.name: slot.weights for slot in live  # strategies that shard: on meta, then each its share
                   if slot.is_pending and STRATEGIES[kinds[slot.name]].shards and not scoped}
    for slot in live:  # empty_init, not sharded: read in stripes (each rank 1 / world of the bytes), broadcast
        if slot.is_pending and slot.name not in shard_later:
            fill_module(slot.module, slot.weights, device, slot.name, replicated=True)
            slot.filled()
    meta_left = bool(shard_later) or len(live) < len(model.slots)
    # placement + autocast; never DDP-wrapped (meta modules are placed by their reading below)
    model = accelerator.prepare_model(model, device_placement=not meta_left, evaluation_mode=True)
    if meta_left:
        for slot in live:
            if slot.name not in shard_later:
                slot.module.to(device)
    prepared = Prepared(device=device)
    if scoped:  # one wrap of the whole composed model, frozen modules included
        fsdp = STRATEGIES["fsdp"]
        settings = fsdp.parse_settings(None, model_settings)
        strategy = fsdp.for_model(settings, meshes.get(shapes[MODEL_SCOPE]), run_dtype)
        strategy.lazy_init = not cast_later
        strategy.apply(model, device)
        keep_output_recording(model)
        prepared.strategies.append(strategy)
        for slot in live:
            slot.wrapped(strategy)
    else:
        for slot in apply_order(live, kinds):  # adopted models: carved-out modules first
            shape = shapes.get(slot.name)
            mesh = meshes.get(shape, dim_names(slot.args.parallelism, len(shape))) if shape else None
            later = slot.name in shard_later or slot.name in cast_later
            strategy = STRATEGIES[kinds[slot.name]].for_module(slot, mesh, lazy_init=not later, meshes=meshes)
            if slot.args.sync_each_batch is not None:
                strategy.sync_each_batch = slot.args.sync_each_batch
            strategy.apply(slot.module, device)
            keep_output_recording(slot.module)  # transformers' output hooks, under the wrapped class names too
            slot.wrapped(strategy)
            if strategy.collective:
                prepared.strategies.append(strategy)
    if model.reduce_every_micro_step:  # adopted models: no accumulation window (`adopt.inputs`)
        prepared.strategies = []
    for name, folder in shard_later.items():  # sharded on meta, then each rank reads its own share
        slot = model.slots[name]
        reading = slot.strategy.reading_device(device)  # FSDP2 keeps offloaded shards on the CPU
        fill_module(slot.module, folder, reading, name)
        if reading != device:  # ... and never moves buffers: they stay where compute runs, as after a placed wrap
            move_buffers(slot.module, device)
    for name in cast_later:
        cast_masters(model.slots[name].module, model.slots[name].precision)
    done = set()  # once all are read and cast: a root's lazy init covers the units nested in it (adopted models)
    for name in [*shard_later, *cast_later]:
        strategy = model.slots[name].strategy
        if id(strategy) not in done:  # (`fsdp_scope: model`: one strategy for every module)
            done.add(id(strategy))
            strategy.after_reading()
    return prepared
