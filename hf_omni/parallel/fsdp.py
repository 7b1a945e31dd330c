"""`parallel: fsdp`: FSDP2 per module, with one Accelerate `FullyShardedDataParallelPlugin(fsdp_version=2)` per
module, applied by hf_omni itself with `fully_shard` (Accelerate only shards its one global model, and never on CPU).

- The plugin is built from the module's `FsdpSettings` (`fsdp_settings.build_plugin`).
- Each parameter is sharded on the dim `placement.shard_dim` picks (dim 0 unless padding it over the shard group
  would exceed 5%: fused MoE experts over more ranks than experts).
- Wrap units: the plugin's auto-wrap policy (Accelerate's helper), the input embeddings as their own unit
  (the composed forward calls them before the module's own forward; each table, for a module with several:
  `embedding_tables`), then the module root.
- Each module root is lazily initialised right away, so a unit called before the root (the embeddings)
  does not claim to be a root itself; methods other than `forward` that the composed forward calls
  (`generate`, `get_image_features`, ...) run through FSDP's hooks via `register_fsdp_forward_method`.
- The layouts the module's `parallelism` sizes ask for (`layout.py`) split it first, on their own dim of its mesh
  or a mesh of their own (`driver.apply_layouts`); FSDP2 then shards the rest over the data dims only (each layout
  shards first what it split on a mesh of its own), and each layout installs its boundary after.
"""

from __future__ import annotations

import torch
from torch import nn

from ..compat import fsdp2_auto_wrap_policy, fsdp_ignored_params, fsdp_lazy_init_root, mark_sharded, own_tensors
from ..core.errors import OmniArgumentError
from ..modules.embeddings import embedding_tables
from ..modules.units import RootedModule, roots_of, run_roots
from . import placement
from .fsdp_settings import FsdpSettings, build_plugin
from .layout import own_dims
from .loose import replicate_loose
from .strategy import FORWARD_METHODS, MODEL_SCOPE, Strategy, register_strategy


@register_strategy
class FsdpStrategy(Strategy):
    """FSDP2 over `mesh` (full shard; HSDP on a 2-D mesh; default: all ranks) with the module's own Accelerate
    plugin. `lazy_init=False`: the module is on the meta device, filled after sharding (`fsdp_lazy_init_root` then)."""

    name = "fsdp"
    description = "FSDP2 per module (full shard, or HSDP on a 2-D mesh), with its own Accelerate plugin"
    settings_class = FsdpSettings
    settings_key = "fsdp_plugin"
    collective = shards = takes_mesh = sync_each_batch = True

    def __init__(self, module_name: str, settings: FsdpSettings, mesh=None, lazy_init: bool = True,
                 compute: torch.dtype | None = None):
        super().__init__(module_name, settings, mesh)
        self.layouts = []  # the module's layouts (`slot.layouts`): what they shard first on a mesh of their own
        self.data_mesh = mesh  # what FSDP2 shards over: the mesh without the layouts' own dims
        self.lazy_init = lazy_init
        self.compute = compute  # the run's compute dtype (bf16: parameters gathered in bf16 unless set otherwise)
        self.plugin = self.module = self.loose = None

    @classmethod
    def for_module(cls, slot, mesh=None, lazy_init: bool = True, meshes=None) -> "FsdpStrategy":
        compute = slot.precision.compute if slot.precision is not None else None
        strategy = cls(slot.name, slot.settings, mesh, lazy_init, compute)
        if slot.dims is not None:
            strategy.layouts, strategy.data_mesh = slot.layouts, slot.dims.data_mesh(mesh)
        return strategy

    @classmethod
    def for_model(cls, settings: FsdpSettings, mesh, compute: torch.dtype | None) -> "FsdpStrategy":
        return cls(MODEL_SCOPE, settings, mesh, compute=compute)

    @classmethod
    def compute_dtype(cls, settings: FsdpSettings, run_dtype: torch.dtype | None) -> torch.dtype | None:
        """`mixed_precision`'s parameter dtype where set, else the run's."""
        return settings.param_dtype(run_dtype)

    @classmethod
    def check_fp16(cls, module: str, settings: FsdpSettings) -> None:
        if settings.cpu_offload:
            raise OmniArgumentError(module, "fsdp_plugin.cpu_offload", "fp16 with an offloaded FSDP module: "
                                    "torch's GradScaler reduces its CPU found-inf over the accelerator's group; "
                                    "use bf16 (no loss scaling) or keep the module on the device")

    def after_reading(self) -> None:
        """Its roots' lazy init, once every module is read (a root's covers the units nested in it)."""
        lazy_init_roots(self.module)

    def reading_device(self, device: torch.device) -> torch.device:
        """FSDP2 keeps offloaded shards on the CPU."""
        return torch.device("cpu") if self.settings.cpu_offload else device

    def apply(self, module: nn.Module, device: torch.device) -> None:
        """Shard `module` (already split by its layouts, `driver.apply_layouts`) over the data dims of its mesh."""
        self.plugin = build_plugin(module, self.module_name, self.settings, self.compute)
        shard(module, self.module_name, self.plugin, device, lazy_init=self.lazy_init, mesh=self.data_mesh,
              layouts=self.layouts)
        self.loose = replicate_loose(module)  # an adopted module's paths that name tensors: whole on every rank
        self.module = module
        for model in [*run_roots(module), getattr(module, "omni_released", None)]:  # `generate` with synced_gpus
            if model is not None:
                mark_sharded(model)

    def set_gradient_sync(self, enabled: bool) -> None:
        """Inside a window: with `sync_each_batch` (the default) every micro-step still reduce-scatters, so each rank
        holds its shard of the gradients only (HSDP: the all-reduce across replicas waits for the window's last);
        without it, each rank holds every unit's whole gradient until the last micro-step. `reshard_after_backward:
        false` also keeps the units gathered inside the window; the last micro-step reshards them."""
        for unit in run_roots(self.module):
            if self.sync_each_batch:
                unit.set_requires_gradient_sync(True)
                unit.set_requires_all_reduce(enabled)  # a 1-D mesh has no all-reduce: nothing changes
            else:
                unit.set_requires_gradient_sync(enabled)
            if not self.settings.reshard_after_backward:
                unit.set_reshard_after_backward(enabled)
        if self.loose is not None:
            self.loose.syncing = enabled

    def full_state_dict(self, module: nn.Module) -> dict[str, torch.Tensor]:
        return full_state_dict(module) if is_sharded(module) else module.state_dict()


def shard(module: nn.Module, name: str, plugin, device: torch.device, lazy_init: bool = True,
          mesh=None, layouts=()) -> nn.Module:
    """Apply `plugin` to `module` in place with `fully_shard` on `mesh` (1-D: full shard; 2-D: HSDP; default: all
    ranks), after the units each of `layouts` shards on its own mesh (experts). `lazy_init=False` for a module on the
    meta device: call `fsdp_lazy_init_root` once its shards are filled."""
    import torch.distributed as dist
    from accelerate.utils import get_module_children_bottom_up
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import (
        CPUOffloadPolicy,
        FSDPModule,
        MixedPrecisionPolicy,
        OffloadPolicy,
        fully_shard,
        register_fsdp_forward_method,
    )

    mesh = mesh if mesh is not None else init_device_mesh(device.type, (dist.get_world_size(),))
    offload = plugin.cpu_offload or OffloadPolicy()
    if isinstance(offload, CPUOffloadPolicy) and device.type == "cpu":  # pinned memory needs an accelerator
        offload = CPUOffloadPolicy(pin_memory=False)
    kwargs = dict(mesh=mesh, reshard_after_forward=plugin.reshard_after_forward, offload_policy=offload,
                  mp_policy=plugin.mixed_precision_policy or MixedPrecisionPolicy(),
                  shard_placement_fn=placement.placement_fn(mesh.size(mesh.ndim - 1)))  # over the shard group
    if plugin.ignored_modules is not None:
        kwargs["ignored_params"] = fsdp_ignored_params(plugin.ignored_modules, module, device)
    for layout in layouts:
        layout.shard_first(module, kwargs)
    try:
        policy = fsdp2_auto_wrap_policy(plugin, module)
    except ValueError as err:
        raise OmniArgumentError(name, "fsdp_plugin.transformer_cls_names_to_wrap", str(err)) from None
    roots = run_roots(module)
    others = {id(m) for r in roots_of(module) for c in r.carved
              for m in r.module.get_submodule(c).modules()}  # carved-out: another module's to wrap
    if policy is not None:
        for root in roots:
            for sub in get_module_children_bottom_up(root)[:-1]:
                if policy(sub) and not isinstance(sub, FSDPModule) and sub not in roots and id(sub) not in others:
                    fully_shard(sub, **kwargs)
    grouped: dict[int, int] = {}  # module -> the first module of its unit, for units of several modules
    for embed in embedding_tables(module):
        if not in_unit(embed):  # not inside a unit already (ViTEmbeddings)
            holders = holders_of(module, embed)  # tied weights (lm_head, T5's shared): one unit for their holders
            fully_shard(holders, **kwargs)
            grouped.update((id(h), id(holders[0])) for h in holders)
    check_ties_within_units(module, name, grouped)
    if isinstance(module, RootedModule):  # an adopted model's module: its released submodules are the units' roots
        shard_part(module, kwargs)
    else:
        fully_shard(module, **kwargs)
    if lazy_init:
        lazy_init_roots(module)
    for root in roots:
        for method in FORWARD_METHODS:
            if callable(getattr(root, method, None)):
                register_fsdp_forward_method(root, method)
    return module


def shard_part(part: RootedModule, kwargs: dict) -> None:
    """Each path of an adopted model's module is a root unit (unless in a unit already: a tied `lm_head`), its
    carved-out descendants' parameters left to their own module. Paths that name one tensor are no unit: they stay
    whole on every rank (`loose.py`)."""
    from torch.distributed.fsdp import FSDPModule, fully_shard

    for root in part.omni_roots:
        if not isinstance(root.module, FSDPModule):
            ignored = set(kwargs.get("ignored_params") or ()) | root.carved_params()
            fully_shard(root.module, **{**kwargs, "ignored_params": ignored or None})


def lazy_init_roots(module: nn.Module) -> None:
    """Initialise the FSDP state of each root of `module` now, unless it lies inside another module's FSDP root
    (a carved-out module: the outer root initialises it)."""
    for root in run_roots(module):
        if not getattr(root, "omni_fsdp_nested", False):
            fsdp_lazy_init_root(root)


def holders_of(module: nn.Module, sub: nn.Module) -> list[nn.Module]:
    """`sub` and every other submodule of `module` (not yet in an FSDP unit) holding one of its parameters."""
    params = {id(p) for p in sub.parameters()}
    out = [sub]
    for other in module.modules():
        if other is not sub and other not in out and not in_unit(other) and any(
                id(p) in params for _, _, p in own_tensors(other, buffers=False)):
            out.append(other)
    return out


def check_ties_within_units(module: nn.Module, name: str, grouped: dict[int, int]) -> None:
    """A parameter held by several submodules (tied weights) must lie in one FSDP unit, or two units would each
    shard it: refused, naming both holders, before anything is sharded further. `grouped`: the modules sharded
    together as one unit (module id -> its unit's first module id)."""
    from torch.distributed.fsdp import FSDPModule

    named = dict(module.named_modules())
    units = {prefix: grouped.get(id(sub), id(sub)) for prefix, sub in named.items() if isinstance(sub, FSDPModule)}
    holders: dict[int, tuple[str, object]] = {}
    for prefix, sub in module.named_modules(remove_duplicate=False):
        inside = max((u for u in units if prefix == u or prefix.startswith(u + ".")), key=len, default=None)
        unit = units[inside] if inside is not None else None
        for _, attr, param in own_tensors(sub, buffers=False):
            tensor = f"{prefix}.{attr}" if prefix else attr
            first = holders.setdefault(id(param), (tensor, unit))
            if first[1] != unit:
                raise OmniArgumentError(name, "fsdp_plugin.transformer_cls_names_to_wrap", (
                    f"{first[0]} and {tensor} are one tied parameter, but would lie in two FSDP units: wrap a layer "
                    "class that holds both, or untie them"))


def in_unit(module: nn.Module) -> bool:
    """Its parameters are in an FSDP unit already (DTensors on more than a layout's own dims: a tensor-parallel split
    alone is no unit)."""
    from torch.distributed.tensor import DTensor

    own = own_dims()
    return any(isinstance(p, DTensor) and not set(p.device_mesh.mesh_dim_names or ()) <= own
               for p in module.parameters())


def is_sharded(module: nn.Module) -> bool:
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in module.parameters())


def full_state_dict(module: nn.Module) -> dict[str, torch.Tensor]:
    """The module's full state dict, gathered — a collective every rank must join. Only rank 0 receives the
    tensors (on CPU, one at a time); other ranks get `{}`."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
