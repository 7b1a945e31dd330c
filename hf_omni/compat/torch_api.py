"""torch internals hf_omni relies on, each behind a named function (indexed in `hf_omni.compat`)."""

from __future__ import annotations

import torch
from torch import nn

from .symbols import MissingInternalError, resolve


# -- torch ----------------------------------------------------------------------------------------------
def own_tensors(module: nn.Module, parameters: bool = True, buffers: bool = True) -> list[tuple[dict, str, object]]:
    """The parameters and buffers a module holds itself, each with its table (`_parameters` / `_buffers`)."""
    tables = ((module._parameters,) if parameters else ()) + ((module._buffers,) if buffers else ())
    return [(table, attr, tensor) for table in tables for attr, tensor in list(table.items()) if tensor is not None]


def fsdp_lazy_init_root(module: nn.Module) -> None:
    """Initialise a `fully_shard`-ed module's FSDP state from its root now (a unit called first is no root)."""
    resolve("torch.distributed.fsdp.FSDPModule._get_fsdp_state")
    module._get_fsdp_state()._lazy_init()


def composable_replicate(module: nn.Module, device: torch.device, ddp_kwargs: dict, ignored_modules=None) -> nn.Module:
    """torch's composable, in-place `replicate` (DDP without a wrapper object), initialised now: parameters are
    broadcast from rank 0 before any method of the module runs."""
    replicate = resolve("torch.distributed._composable.replicate.replicate")
    kwargs = dict(ddp_kwargs, **({"device_id": device} if device.type != "cpu" else {}))
    replicate(module, ignored_modules=ignored_modules or None, **kwargs)
    replicate.state(module).lazy_init()
    return module


def queue_backward_callback(callback) -> None:
    """Run `callback` once the current backward pass has finished (autograd's engine queue)."""
    resolve("torch.autograd.Variable._execution_engine").queue_callback(callback)


def scaler_state(scaler, optimizer) -> dict:
    """What torch's GradScaler keeps for `optimizer` since its last `update()` (`{}`: nothing yet; after
    `unscale_`, `found_inf_per_device`: device -> tensor, the dict its `step` and `update` read)."""
    resolve("torch.amp.grad_scaler._refresh_per_optimizer_state")
    states = getattr(scaler, "_per_optimizer_states", None)
    if states is None:
        raise MissingInternalError("hf_omni relies on torch's GradScaler keeping `_per_optimizer_states`, which the "
                                   "installed torch does not")
    return states[id(optimizer)] if id(optimizer) in states else {}


def scaler_device(scaler) -> torch.device:
    """The device of the scaler's scale (the same on every rank)."""
    device = getattr(scaler, "_device", None)
    if device is None:
        raise MissingInternalError("hf_omni relies on torch's GradScaler keeping its device in `_device`, which the "
                                   "installed torch does not")
    return torch.device(device)


def dcp_sharding_info_key() -> str:
    """The safetensors header field DCP's HuggingFaceStorageReader reads each shard's offsets from."""
    return resolve("torch.distributed.checkpoint._hf_utils.DCP_SHARDING_INFO_KEY")


def dcp_shard_index(plan) -> int:
    """The number HuggingFaceStorageWriter gives this rank's files (`save_distributed`: one per rank, from 1)."""
    if "shard_index" not in (plan.storage_data or {}):
        raise MissingInternalError("hf_omni relies on torch's HuggingFaceStorageWriter putting `shard_index` in each "
                                   "rank's plan (save_distributed), which the installed torch does not")
    return plan.storage_data["shard_index"]


def dtensor_over(tensor, local: torch.Tensor):
    """A DTensor of `tensor`'s mesh, placements and global shape over `local` where it lies (a host copy of its
    shard: `DTensor.from_local` would move it to the mesh's device); what DCP plans a write from."""
    from torch.distributed.tensor import DTensor

    resolve("torch.distributed.tensor.DTensor._spec")
    return DTensor(local, tensor._spec, requires_grad=False)


def in_place_wrapper_classes() -> tuple[type, ...]:
    """The classes FSDP2 and composable replicate mix into a module's generated subclass."""
    from torch.distributed.fsdp import FSDPModule

    return (FSDPModule, resolve("torch.distributed._composable.replicate.DDP"))


def keeps_running_stats(module: nn.Module) -> bool:
    """A batch / instance norm layer (torch's `_NormBase`) that updates running statistics in training."""
    return isinstance(module, resolve("torch.nn.modules.batchnorm._NormBase")) and module.track_running_stats


def tree_flatten(tree) -> tuple[list, object]:
    """torch's pytree flattening (`torch.utils._pytree`): the leaves of nested dicts / lists / tuples and a spec."""
    return resolve("torch.utils._pytree.tree_flatten")(tree)


def tree_unflatten(leaves: list, spec):
    """The nested structure `tree_flatten` read `spec` from, with `leaves` in place of its leaves."""
    return resolve("torch.utils._pytree.tree_unflatten")(leaves, spec)


def torch_dispatch_mode() -> type:
    """torch's `TorchDispatchMode` base class: a subclass's `__torch_dispatch__` sees every ATen call made under it."""
    return resolve("torch.utils._python_dispatch.TorchDispatchMode")


def op_schema_name(func) -> str:
    """An ATen operator overload's qualified name, namespace included (`_c10d_functional::all_reduce`)."""
    resolve("torch.ops.aten.add.default._schema")
    return func._schema.name


def resolve_process_group(name: str):
    """The process group a functional collective names by its string (`group_name`)."""
    return resolve("torch.distributed.distributed_c10d._resolve_process_group")(name)


def wrap_dcp_hf_read_request(wrap) -> None:
    """Replace, for the rest of the process, DCP's HuggingFaceStorageReader per-request read (one tensor slice) by
    `wrap(original)`, called as `original(self, f, req, planner)`."""
    from torch.distributed.checkpoint.hf_storage import HuggingFaceStorageReader

    original = resolve("torch.distributed.checkpoint.hf_storage.HuggingFaceStorageReader._process_read_request")
    HuggingFaceStorageReader._process_read_request = wrap(original)


def scheduler_step_count(scheduler) -> int:
    """torch's `LRScheduler._step_count`: 1 after its constructor, plus one a step (Accelerate counts skipped
    micro-steps on it)."""
    if not hasattr(scheduler, "_step_count"):
        raise MissingInternalError("hf_omni relies on torch's LRScheduler keeping `_step_count`, which this "
                                   "scheduler does not")
    return scheduler._step_count


def set_scheduler_step_count(scheduler, count: int) -> None:
    """Set `LRScheduler._step_count` (a scheduler whose constructor did not run starts at 1, as torch's leaves it)."""
    scheduler._step_count = count


def group_options(device_type: str, timeout_s: float):
    """(backend, options carrying `timeout_s`) for a new group serving `device_type` (`init_device_mesh`'s
    `backend_override`): gloo on the CPU, NCCL on CUDA; None elsewhere (those groups keep their backend's default)."""
    import datetime

    import torch.distributed as dist

    if device_type == "cpu":
        backend, options = "gloo", resolve("torch.distributed.ProcessGroupGloo._Options")()
    elif device_type == "cuda" and dist.is_nccl_available():
        backend, options = "nccl", dist.ProcessGroupNCCL.Options()
    else:
        return None
    options._timeout = datetime.timedelta(seconds=timeout_s)
    return backend, options


def group_timeout(group, device_type: str):
    """The timeout of `group`'s backend for `device_type` (a `datetime.timedelta`)."""
    import torch

    return group._get_backend(torch.device(device_type)).options._timeout


def set_group_timeout(group, timeout_s: float) -> None:
    """Give an existing group (the default one) the timeout `timeout_s`."""
    import datetime

    resolve("torch.distributed.distributed_c10d._set_pg_timeout")(datetime.timedelta(seconds=timeout_s), group)


def init_fake_process_group(rank: int, world_size: int) -> None:
    """A default process group of `world_size` ranks, this process as `rank`, whose collectives move nothing
    (torch's testing `fake` backend): enough to shard modules as any one rank of a large world would."""
    import torch.distributed as dist

    store = resolve("torch.testing._internal.distributed.fake_pg.FakeStore")
    dist.init_process_group("fake", store=store(), rank=rank, world_size=world_size)


def strided_shard_factor(placement) -> int | None:
    """The split factor of a DTensor `_StridedShard(dim, sf)` placement (FSDP2 over a tensor already sharded on the
    same dim: the number of parts the mesh dims after it cut the dim into first), None for any other placement."""
    strided = resolve("torch.distributed.tensor.placement_types._StridedShard")
    return int(placement.split_factor) if isinstance(placement, strided) else None


def fsdp_padded_shards(module: nn.Module) -> dict[str, tuple[int, torch.Size]]:
    """{parameter name: (the dim FSDP2 shards it on, the padded shard this rank keeps)} for every parameter of the
    `fully_shard` units in `module` (an all-gather of a parameter moves that padded shard from every rank of its
    shard group)."""
    from torch.distributed.fsdp import FSDPModule

    resolve("torch.distributed.fsdp.FSDPModule._get_fsdp_state")
    names = {id(p): n for n, p in module.named_parameters()}
    out = {}
    for sub in module.modules():
        if not isinstance(sub, FSDPModule):
            continue
        group = getattr(sub._get_fsdp_state(), "_fsdp_param_group", None)
        for param in (group.fsdp_params if group is not None else ()):
            if not hasattr(param, "padded_sharded_param_size"):
                raise MissingInternalError("hf_omni relies on torch's FSDPParam keeping `padded_sharded_param_size`, "
                                           "which the installed torch does not")
            out[names[id(param.sharded_param)]] = (param.fsdp_placement.dim, param.padded_sharded_param_size)
    return out


def flatten_mesh(mesh, names: tuple[str, ...]) -> str:
    """Dims `names` of `mesh` flattened into one (`DeviceMesh._flatten`, as torchtitan flattens `dp_shard x cp`);
    returns the flat dim's name, by which `mesh[...]` slices it (torch 2.13 warns that slicing a flattened dim from
    the root mesh will go: then keep the flattened mesh instead)."""
    flat = "_".join(names)
    resolve("torch.distributed.device_mesh.DeviceMesh._flatten")
    mesh[names]._flatten(flat)
    return flat

