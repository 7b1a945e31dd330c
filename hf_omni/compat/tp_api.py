"""transformers' tensor-parallel machinery (`transformers.distributed`, 5.x), behind named functions (indexed in
`hf_omni.compat`): the module class's own plan, and applying it on a 1-D `tp` mesh."""

from __future__ import annotations

from torch import nn

from .symbols import resolve


def tensor_parallel_plan(module: nn.Module, tp_size: int, dp_shard_size: int, dp_replicate_size: int) -> dict:
    """`module`'s resolved tensor-parallel plan (one entry per parameter to shard and per module to hook; `*`
    expanded to layer numbers) at these sizes; `{}` when its class and config declare none."""
    from transformers.distributed import DistributedConfig

    resolve("transformers.PreTrainedModel._resolve_parallel_plans")
    if not hasattr(module, "_resolve_parallel_plans"):  # not a transformers model
        return {}
    config = DistributedConfig(tp_size=tp_size, fsdp_size=dp_shard_size, dp_replicate_size=dp_replicate_size)
    try:
        return dict(module._resolve_parallel_plans(config)[0])
    except ValueError as err:  # "tp_size=2 was requested, but X has no tp_plan"
        if "tp_plan" in str(err):
            return {}
        raise


def apply_tensor_plan(module: nn.Module, tp_mesh, plan: dict) -> None:
    """Shard `module`'s parameters by `plan` on `tp_mesh` (DTensors; no communication: each rank keeps its chunk of
    what it holds) and install the styles' forwards (plain tensors between layers). `_mesh_manager` is what the
    `unit_*` styles read (here the dense mesh stands for the expert one too: no expert parallelism yet)."""
    from transformers.distributed.tensor_parallel import apply_tensor_parallelism
    from transformers.distributed.utils import TransformersDeviceMesh

    resolve("transformers.distributed.utils.TransformersDeviceMesh")
    module._mesh_manager = TransformersDeviceMesh(tp_mesh, tp_mesh)
    apply_tensor_parallelism(module, tp_mesh, plan)
