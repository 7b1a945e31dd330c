"""diffusers' context parallelism (`ContextParallelConfig`, its attention dispatch, the model class's `_cp_plan`
hooks; marked experimental there), behind named functions (indexed in `hf_omni.compat`): which models it reaches,
and enabling it over a mesh of hf_omni's."""

from __future__ import annotations

import sys

import torch
from torch import nn

from .symbols import resolve


def _processors(module: nn.Module) -> list:
    """The attention processors of `module` that take diffusers' parallel config."""
    if "diffusers" not in sys.modules:  # a diffusers model exists only once diffusers is imported
        return []
    mixin = resolve("diffusers.models.attention.AttentionModuleMixin")
    classic = resolve("diffusers.models.attention_processor.Attention")
    return [m.processor for m in module.modules() if isinstance(m, (mixin, classic))
            and getattr(m, "processor", None) is not None and hasattr(m.processor, "_parallel_config")]


def context_parallel_plan(module: nn.Module) -> dict | None:
    """The class's `_cp_plan` (where its sequence is split and gathered) of a diffusers model whose attention
    processors take a parallel config; None for any other module."""
    if "diffusers" not in sys.modules or not isinstance(module, resolve("diffusers.ModelMixin")):
        return None
    plan = getattr(module, "_cp_plan", None)
    return dict(plan) if plan and _processors(module) else None


def attention_backend_without_context_parallel(module: nn.Module) -> str | None:
    """The attention backend `module`'s processors dispatch to, where diffusers serves no context parallelism on it
    (its backends without `supports_context_parallel`); None when it does."""
    registry = resolve("diffusers.models.attention_dispatch._AttentionBackendRegistry")
    names = resolve("diffusers.models.attention_dispatch.AttentionBackendName")
    for processor in _processors(module)[:1]:  # one backend for every processor (as `enable_parallelism` reads)
        backend = getattr(processor, "_attention_backend", None)
        backend = names(backend) if backend is not None else registry.get_active_backend()[0]
        if not registry._is_context_parallel_available(backend):
            return backend.value
    return None


def plan_modules(module: nn.Module, path: str) -> list[nn.Module]:
    """The modules a `_cp_plan` path names in `module` ("" itself, `*` each child of a `ModuleList`)."""
    found = resolve("diffusers.hooks.context_parallel._get_submodule_by_name")(module, path)
    return found if isinstance(found, list) else [found]


def enable_context_parallel(module: nn.Module, mesh, ulysses: int, ring: int = 1, check_output=None) -> None:
    """What `ModelMixin.enable_parallelism(config=ContextParallelConfig(ulysses_degree=..., ring_degree=...))` does,
    on `mesh` (the module's own group, 1-D) seen as diffusers' `ring` x `ulysses` mesh, with the device this rank runs
    on: diffusers' own takes it as `rank % torch.accelerator.device_count()`, which divides by zero on a machine
    without an accelerator. Its split and gather hooks go on the paths of the class's `_cp_plan`, and every attention
    processor is given the config (its attention then exchanges over the group). `check_output(path, index, split,
    tensor)`, where given, sees each output the plan splits before diffusers does (a hook of diffusers' registry inside
    the split's)."""
    resolve("diffusers.models.modeling_utils.ModelMixin._parallel_config")
    resolve("torch.distributed.device_mesh.DeviceMesh._unflatten")
    apply = resolve("diffusers.hooks.context_parallel.apply_context_parallel")
    from diffusers.models._modeling_parallel import ContextParallelConfig, ParallelConfig

    if getattr(module, "_parallel_config", None) is not None:
        raise RuntimeError(f"{type(module).__name__} has diffusers parallelism applied already")
    if mesh.size() != ulysses * ring:
        raise ValueError(f"a mesh of {mesh.size()} ranks for ring {ring} x ulysses {ulysses}")
    cp_mesh = mesh._unflatten(0, (ring, ulysses), ("ring", "ulysses"))
    cp = ContextParallelConfig(ring_degree=ring, ulysses_degree=ulysses, mesh=cp_mesh)
    config = ParallelConfig(context_parallel_config=cp)
    device = torch.device(mesh.device_type, torch.accelerator.current_device_index()) \
        if mesh.device_type != "cpu" else torch.device("cpu")
    config.setup(torch.distributed.get_rank(), torch.distributed.get_world_size(), device, mesh=cp_mesh)
    module._parallel_config = config
    for processor in _processors(module):
        processor._parallel_config = config
    if check_output is not None:
        _hook_outputs(module, check_output)
    apply(module, cp, module._cp_plan)


def _hook_outputs(module: nn.Module, check_output) -> None:
    """`check_output` on each output the class's `_cp_plan` splits, registered before the plan's hooks: diffusers
    runs the first registered innermost, so it sees the output before the split does."""
    registry = resolve("diffusers.hooks.hooks.HookRegistry")
    base = resolve("diffusers.hooks.hooks.ModelHook")

    class Check(base):
        def __init__(self, path: str, splits: dict):
            super().__init__()
            self.path, self.splits = path, splits

        def post_forward(self, part, output):
            values = [output] if isinstance(output, torch.Tensor) else list(output)
            for index, split in self.splits.items():
                if index < len(values):
                    check_output(self.path, index, split, values[index])
            return output

    for path, entry in module._cp_plan.items():
        splits = {k: v for k, v in entry.items() if getattr(v, "split_output", False)} \
            if isinstance(entry, dict) else {}
        for part in plan_modules(module, path) if splits else []:
            registry.check_if_exists_or_initialize(part).register_hook(Check(path, splits),
                                                                           f"hf_omni_split_check---{path}")
