"""What is done to every module's gradients between backward and the optimizer step: their norms (per module, on
the compute device, DTensor-aware), clipping per module or globally, and fp16's found-inf made one answer for all
modules and ranks. Nothing here reads device memory on the host."""

from __future__ import annotations

import functools

import torch
from torch import nn

from ..compat import scaler_device, scaler_state
from ..core.dist import checkpoint_group, world_size


def grad_groups(params: list[nn.Parameter]) -> list[list[nn.Parameter]]:
    """`params` that have gradients, in groups torch's norms and foreach ops each take whole: the sharded (DTensor)
    gradients by their mesh, the plain ones (an adopted module's loose tensors, beside its sharded submodules:
    `parallel.loose`) together. A module under tensor parallelism has several meshes: its split layers on
    `(dp_shard, tp)`, the layers it leaves whole (norms) sharded by FSDP on `(dp_shard,)` alone."""
    from torch.distributed.tensor import DTensor

    groups: dict = {}
    for param in params:
        if param.grad is not None:
            key = param.grad.device_mesh if isinstance(param.grad, DTensor) else None
            groups.setdefault(key, []).append(param)
    return list(groups.values())


def module_grad_norm(params: list[nn.Parameter], device: torch.device, norm_type: float = 2.0) -> torch.Tensor:
    """The `norm_type` norm (L2 by default; inf: the largest magnitude) of the module's gradients, on `device`
    (where the modules compute); for sharded (DTensor) gradients the full norm over all ranks. Each group of
    `grad_groups` (one mesh, or the plain gradients) has its norm, and those norms are combined on `device` (the
    p-norm of the group norms; no host read). The local norm moves to `device` before it is reduced: an offloaded
    module's shards and gradients live on the CPU, its mesh's group on the accelerator. A module with no gradients
    has norm 0."""
    norms = [_norm([p.grad for p in group], device, norm_type) for group in grad_groups(params)]
    if not norms:
        return torch.zeros((), device=device)
    if len(norms) == 1:
        return norms[0]
    dtype = functools.reduce(torch.promote_types, (n.dtype for n in norms))  # groups of different dtypes
    return torch.linalg.vector_norm(torch.stack([n.to(dtype) for n in norms]), norm_type)


def _norm(grads: list[torch.Tensor], device: torch.device, norm_type: float) -> torch.Tensor:
    from torch.distributed.tensor import DTensor
    from torch.nn.utils import get_total_norm

    norm = get_total_norm(grads, norm_type)
    if isinstance(norm, DTensor):
        local = norm.to_local()
        if local.device != device:
            norm = DTensor.from_local(local.to(device, non_blocking=True), norm.device_mesh, norm.placements)
        norm = norm.full_tensor()
    return norm.to(device, non_blocking=True)


def clip_grad_norms(optimizer, limits: dict[str, float], global_limit: float | None,
                    device: torch.device | None = None, norm_type: float = 2.0
                    ) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """`optimizer`: the modules' `optimizers.ModuleOptimizers`. Each module's pre-clip gradient norm on `device`
    (default: its first parameter's), and the combined one (the `norm_type` norm of the modules' norms: L2,
    sqrt(sum of squares), by default). With `global_limit` every module is clipped to it by the combined norm; else
    each module to its own limit (0: none); each of a module's `grad_groups` is scaled by that one norm. An
    offloaded module's CPU gradients are scaled by a norm on the accelerator: torch copies that one number to the
    host (its optimizer steps there anyway)."""
    from torch.nn.utils import clip_grads_with_norm_

    optimizer.unscale_()  # fp16: true gradients before norms and clipping
    grads = {name: [p for p in params if p.grad is not None] for name, params in optimizer.params.items()}
    norms = {name: module_grad_norm(params, device or optimizer.params[name][0].device, norm_type)
             for name, params in grads.items()}
    total = torch.linalg.vector_norm(torch.stack([n.float() for n in norms.values()]), norm_type)
    for name, params in grads.items():
        limit, norm = (global_limit, total) if global_limit is not None else (limits[name], norms[name])
        if params and limit and limit > 0:
            for group in grad_groups(params):  # torch's foreach takes one mesh (or plain tensors) at a time
                clip_grads_with_norm_(group, limit, norm)
    return norms, total


def share_found_inf(scaler, optimizers: list[torch.optim.Optimizer]) -> torch.Tensor:
    """After `unscale_` of every optimizer: the sum of all their found-inf tensors, on the scaler's device and over
    every rank (one scalar all-reduce; torch's DTensor rule reduces only a sharded module's, over one mesh). It
    becomes each optimizer's, so `scaler.update()` backs off alike on every rank, and is returned (no host read
    here). An optimizer none of whose parameters has a gradient adds 0."""
    import torch.distributed as dist

    device = scaler_device(scaler)  # one device on every rank, so one group
    found = [scaler_state(scaler, opt).setdefault("found_inf_per_device", {}) for opt in optimizers]
    total = torch.zeros((), dtype=torch.float32, device=device)
    for tensor in (t for per_device in found for t in per_device.values()):
        total += tensor.to(device, non_blocking=True)
    if world_size() > 1:  # a CPU scalar goes over hf_omni's gloo group (an NCCL-only group takes no CPU tensor)
        dist.all_reduce(total, group=checkpoint_group() if device.type == "cpu" else None)
    for per_device in found:
        per_device.clear()
        per_device[device] = total.clone()  # one each: update() adds them up in place
    return total


def fp16_scaler(accelerator, slots: dict):
    """The Accelerator's GradScaler (fp16; None otherwise), shared by every module. Each module's strategy refuses
    settings it cannot serve (an FSDP module kept on the CPU: torch's GradScaler reduces a sharded gradient's
    found-inf over its mesh, whose group is the accelerator's, and that module's found-inf is a CPU tensor)."""
    scaler = getattr(accelerator, "scaler", None)
    if scaler is not None and scaler.is_enabled():
        for name, slot in slots.items():
            if slot.strategy is not None:
                type(slot.strategy).check_fp16(name, slot.strategy.settings)
    return scaler
