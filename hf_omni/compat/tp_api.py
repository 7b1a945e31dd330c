"""transformers' tensor- and expert-parallel machinery (`transformers.distributed`, 5.x), behind named functions
(indexed in `hf_omni.compat`): the module class's own plans, and applying them on 1-D `tp` / `ep` meshes; and its
attention interface, which sequence parallelism wraps."""

from __future__ import annotations

from torch import nn

from .symbols import resolve


def _plans(module: nn.Module, **sizes) -> tuple[dict, dict] | None:
    """(tensor-parallel plan, expert-parallel plan) transformers resolves for `module` at these `DistributedConfig`
    sizes (one entry per parameter to shard and per module to hook; `*` expanded to layer numbers); None for a module
    that is not a transformers model."""
    from transformers.distributed import DistributedConfig

    resolve("transformers.PreTrainedModel._resolve_parallel_plans")
    if not hasattr(module, "_resolve_parallel_plans"):  # not a transformers model
        return None
    tp, ep, _ = module._resolve_parallel_plans(DistributedConfig(**sizes))
    return dict(tp), dict(ep)


def tensor_parallel_plan(module: nn.Module, tp_size: int, dp_shard_size: int, dp_replicate_size: int,
                         ep_size: int = 1) -> dict:
    """`module`'s resolved tensor-parallel plan at these sizes; `{}` when its class and config declare none. With
    `ep_size`, transformers leaves the experts to the expert-parallel plan (5.23 otherwise splits them by tp)."""
    try:
        plans = _plans(module, tp_size=tp_size, ep_size=ep_size, fsdp_size=dp_shard_size,
                       dp_replicate_size=dp_replicate_size)
    except ValueError as err:  # "tp_size=2 was requested, but X has no tp_plan"
        if "tp_plan" in str(err):
            return {}
        raise
    return plans[0] if plans else {}


def expert_parallel_plan(module: nn.Module, ep_size: int, dp_shard_size: int, dp_replicate_size: int,
                         tp_size: int = 1) -> dict:
    """`module`'s resolved expert-parallel plan (`config.base_model_ep_plan`: fused expert weights `grouped_gemm`,
    their modules `ep_dispatch_experts`) at these sizes; `{}` when its config declares none. transformers' own
    sizing errors (`ep_size` must divide `fsdp_size * tp_size`) propagate as its ValueError."""
    plans = _plans(module, ep_size=ep_size, tp_size=tp_size, fsdp_size=dp_shard_size,
                   dp_replicate_size=dp_replicate_size)
    return plans[1] if plans else {}


def apply_tensor_plan(module: nn.Module, tp_mesh, plan: dict) -> None:
    """Shard `module`'s parameters by `plan` on `tp_mesh` (DTensors; no communication: each rank keeps its chunk of
    what it holds) and install the styles' forwards (plain tensors between layers). `_mesh_manager` is what the
    `unit_*` styles read (tensor parallelism alone: the dense mesh stands for the expert one)."""
    from transformers.distributed.tensor_parallel import apply_tensor_parallelism
    from transformers.distributed.utils import TransformersDeviceMesh

    resolve("transformers.distributed.utils.TransformersDeviceMesh")
    resolve("transformers.distributed.tensor_parallel.apply_tensor_parallelism")
    module._mesh_manager = TransformersDeviceMesh(tp_mesh, tp_mesh)
    apply_tensor_parallelism(module, tp_mesh, plan)


def apply_expert_plan(module: nn.Module, ep_mesh, tp_mesh, plan: dict) -> None:
    """Spread `module`'s fused experts by `plan` over `ep_mesh` (`Shard(0)` DTensors of whole experts, the experts'
    count set to the local one; no communication) and route tokens to them with transformers' all-to-all
    implementation (`AllToAllEP`: each rank keeps its own batch; `tp_mesh`: the ranks sharing one batch, this rank
    alone without tensor parallelism)."""
    from transformers.distributed.expert_parallel import apply_expert_parallelism

    resolve("transformers.distributed.expert_parallel.apply_expert_parallelism")
    apply_expert_parallelism(module, ep_mesh, tp_mesh, plan, ep_implementation="all_to_all")


def mark_sharded(module: nn.Module) -> None:
    """Make transformers' `generate` on `module` run with `synced_gpus=True` (what it does for a model it sharded
    itself): ranks whose sequences end first keep joining the sharded module's collectives (FSDP2's gathers, the
    experts' all-to-alls) until every rank is done, instead of leaving the others waiting."""
    resolve("transformers.distributed.fsdp.is_fsdp_managed_module")
    module._is_fsdp_managed_module = True  # the attribute `is_fsdp_managed_module` reads


def attention_of(module: nn.Module) -> str | None:
    """The attention implementation `module` runs through transformers' attention interface (`sdpa`, `eager`, ...),
    or None when the module cannot set one (not a transformers model, or a class outside the interface)."""
    resolve("transformers.PreTrainedModel._can_set_attn_implementation")
    resolve("transformers.PretrainedConfig._attn_implementation")
    settable = getattr(module, "_can_set_attn_implementation", None)
    if getattr(module, "config", None) is None or not callable(settable) or \
            not callable(getattr(module, "set_attn_implementation", None)) or not settable():
        return None
    return module.config._attn_implementation or "eager"


def set_attention(module: nn.Module, name: str, function) -> None:
    """Register `function` under `name` in transformers' attention interface and make `module` run it."""
    from transformers import AttentionInterface

    AttentionInterface.register(name, function)
    module.set_attn_implementation(name)

