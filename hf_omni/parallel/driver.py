"""How the modules of a composed model are wrapped, as named steps read top to bottom (torchtitan style), each one
function over every module. `OmniPlugin.prepare_modules` runs the steps before them: resolve (each slot's arguments,
settings, dimensions) -> check (the refusals registered for resolved settings) -> tune (freeze | LoRA ->
activation checkpointing, `tune.py`) -> check (the refusals registered for tuned modules); then:

    plan            each module's strategy (no process group: none everywhere) and flags; every layout's refusal
    build_meshes    each module's device mesh (`dims.ModuleDims`), and its layouts' instances
    set_masters     master dtypes of what trains; cast now where not sharded (`empty_init`: on meta, no memory)
    read_whole      `empty_init` modules not sharded: read in stripes (each rank 1 / world of the bytes), broadcast
    place           on the device (meta modules are placed by their reading)
    apply_layouts   each module's layouts split it (tensor parallelism) before it is sharded
    wrap            each module's strategy applied in place (shard / replicate); carved-out modules first
    install_boundaries  what the rest of the composed model needs around a split module
    read_shards     `empty_init` modules sharded on meta: each rank reads its own share
    cast_shares     the masters of loaded modules now sharded: each rank casts its shares only
    finish          each sharding strategy's lazy init, once every module is read and cast

A module loaded whole and then sharded gets its fp32 masters after sharding: each rank allocates 1 / world of them
where a cast before would allocate the whole module on every rank; `empty_init` modules are cast on the meta device,
so their files are read straight into the masters. Every refusal that needs the modules comes before anything is
placed or wrapped. Each slot records what was applied (`ModuleSlot.wrapped(strategy)`); `Prepared` is what the
composed model needs at run time.
"""

from __future__ import annotations

from ..compat import keep_output_recording
from ..core.dist import has_process_group, world_size
from ..files.weights import fill_module, move_buffers
from ..modules.precision import apply_master_dtype, cast_masters, run_compute_dtype
from .dims import Meshes, ModuleDims
from .nesting import apply_order
from .prepared import ModulePlan, Prepared, Run
from .strategy import FORWARD_METHODS, MODEL_SCOPE, STRATEGIES


def prepare_modules(accelerator, model, *, fsdp_scope: str, model_settings: dict | None = None,
                    timeout_s: float | None = None) -> Prepared:
    """Place, wrap and (for `empty_init` modules) read every module that is not offline; each slot ends wrapped.
    `model_settings`: the top-level `fsdp_plugin` (`fsdp_scope: model`: the one wrap of the composed model);
    `timeout_s`: the timeout of the groups the modules' meshes make (`ddp_timeout`)."""
    run = plan(accelerator, model, fsdp_scope, model_settings, timeout_s)
    build_meshes(run)
    set_masters(run)
    read_whole(run)
    place(run)
    apply_layouts(run)
    wrap(run)
    install_boundaries(run)
    read_shards(run)
    cast_shares(run)
    return finish(run)


def kind_of(slot, fsdp_scope: str) -> str:
    """No process group: every module runs as it is. Otherwise a trainable module as its `parallel` says; a fully
    frozen one only when its own entry asks for a strategy that shards (`parallel: fsdp`, ...); under
    `fsdp_scope: model`, all of them inside the one wrap of the composed model."""
    if not has_process_group():
        return "none"
    if fsdp_scope == "model":
        return "fsdp"
    margs = slot.args
    return margs.parallel if slot.trains or (margs.parallel_from_module and margs.strategy.shards) else "none"


def plan(accelerator, model, fsdp_scope: str, model_settings: dict | None, timeout_s: float | None) -> Run:
    """Each module's strategy, dimensions and flags, in the order every step takes them; every refusal that needs the
    modules (a mesh the world does not fit, a layout a module cannot take) before anything is placed."""
    model.sync_parts()  # an adopted model: submodules PEFT replaced, into the released model
    scoped = fsdp_scope == "model" and has_process_group()
    run = Run(accelerator, model, accelerator.device, run_compute_dtype(accelerator), scoped, model_settings,
              Meshes(accelerator.device.type, timeout_s))
    for slot in model.slots.values():
        if slot.is_offline:  # on meta for good
            continue
        strategy = STRATEGIES[kind_of(slot, fsdp_scope)]
        dims = ModuleDims.parse(slot.name, slot.args.parallelism, world_size()) \
            if strategy.takes_mesh and not scoped else None  # every mesh error before anything is placed
        sharded = strategy.shards
        run.plans.append(ModulePlan(slot, strategy, dims, read_after=slot.weights if sharded and not scoped else None,
                                    sharded=sharded and not slot.is_pending))
        for layout in dims.layouts_of() if dims is not None else ():  # a module without a tensor-parallel plan, ...
            layout.check(slot.module)
    run.plans = apply_order(run.plans)  # adopted models: carved-out modules first; every step in this order
    if scoped and run.plans:  # the top-level parallelism (every module's)
        run.model_dims = ModuleDims.parse(None, run.plans[0].slot.args.parallelism, world_size())
    return run


def build_meshes(run: Run) -> None:
    for item in run.plans:
        if item.dims is not None:
            item.mesh = item.dims.mesh(run.meshes)
            item.slot.dims, item.slot.layouts = item.dims, item.dims.layouts_of(run.meshes)


def set_masters(run: Run) -> None:
    """Before anything is read, placed or wrapped: what is not sharded is cast now (on meta: no memory)."""
    for item in run.plans:
        item.slot.precision = apply_master_dtype(item.slot, run.run_dtype, cast=not item.sharded)
        item.cast_after = item.sharded and bool(item.slot.precision.masters)


def read_whole(run: Run) -> None:
    for item in run.plans:
        if item.slot.is_pending and item.read_after is None:
            fill_module(item.slot.module, item.slot.weights, run.device, item.slot.name, replicated=True)
            item.slot.filled()


def place(run: Run) -> None:
    """Placement + autocast, never DDP-wrapped (meta modules are placed by their reading)."""
    meta_left = any(item.read_after is not None for item in run.plans) or len(run.plans) < len(run.model.slots)
    run.accelerator.prepare_model(run.model, device_placement=not meta_left, evaluation_mode=True)
    for item in run.plans if meta_left else ():
        if item.read_after is None:
            item.slot.module.to(run.device)


def apply_layouts(run: Run) -> None:
    for item in run.plans:
        for layout in item.slot.layouts:
            layout.apply(item.slot.module, item.mesh)


def wrap(run: Run) -> None:
    if run.scoped:  # one wrap of the whole composed model, frozen modules included
        fsdp = STRATEGIES["fsdp"]
        settings = fsdp.parse_settings(None, run.model_settings)
        strategy = fsdp.for_model(settings, run.model_dims.mesh(run.meshes), run.run_dtype)
        strategy.lazy_init = not any(item.cast_after for item in run.plans)
        strategy.apply(run.model, run.device)
        keep_output_recording(run.model)
        run.prepared.strategies.append(strategy)
        for item in run.plans:
            item.slot.wrapped(strategy)
        return
    for item in run.plans:
        slot = item.slot
        later = item.read_after is not None or item.cast_after
        strategy = item.strategy.for_module(slot, item.mesh, lazy_init=not later, meshes=run.meshes)
        if slot.args.sync_each_batch is not None:
            strategy.sync_each_batch = slot.args.sync_each_batch
        strategy.apply(slot.module, run.device)
        keep_output_recording(slot.module)  # transformers' output hooks, under the wrapped class names too
        slot.wrapped(strategy)
        if strategy.collective:
            run.prepared.strategies.append(strategy)
    if run.model.reduce_every_micro_step:  # adopted models: no accumulation window (`adopt.inputs`)
        run.prepared.strategies = []


def install_boundaries(run: Run) -> None:
    for item in run.plans:
        for layout in item.slot.layouts:
            layout.after_fsdp(item.slot.module, item.mesh, FORWARD_METHODS)


def read_shards(run: Run) -> None:
    """Sharded on meta, then each rank reads its own share."""
    for item in run.plans:
        if item.read_after is not None:
            slot = item.slot
            reading = slot.strategy.reading_device(run.device)  # FSDP2 keeps offloaded shards on the CPU
            fill_module(slot.module, item.read_after, reading, slot.name)
            if reading != run.device:  # ... and never moves buffers: they stay where compute runs
                move_buffers(slot.module, run.device)


def cast_shares(run: Run) -> None:
    for item in run.plans:
        if item.cast_after:
            cast_masters(item.slot.module, item.slot.precision)


def finish(run: Run) -> Prepared:
    """Once all are read and cast: a root's lazy init covers the units nested in it (adopted models)."""
    done = set()
    for item in run.plans:
        strategy = item.slot.strategy
        if (item.read_after is not None or item.cast_after) and id(strategy) not in done:  # (scoped: one)
            done.add(id(strategy))
            strategy.after_reading()
    return run.prepared


__all__ = ["MODEL_SCOPE", "Prepared", "prepare_modules"]
