"""What is done to every module's gradients between backward and the optimizer step: their norms (per module, on
the compute device, DTensor-aware), clipping per module or globally, and fp16's found-inf made one answer for all
modules and ranks. Nothing here reads device memory on the host."""

from __future__ import annotations

import torch
from torch import nn

from ..compat import scaler_device, scaler_state
from ..dist import checkpoint_group, world_size


def module_grad_norm(params: list[nn.Parameter], device: torch.device) -> torch.Tensor:
    """L2 norm of the module's gradients, on `device` (where the modules compute); for sharded (DTensor) gradients
    the full norm over all ranks. The local norm moves to `device` before it is reduced: an offloaded module's
    shards and gradients live on the CPU, its mesh's group on the accelerator. A module with no gradients has
    norm 0."""
    from torch.distributed.tensor import DTensor

    if not params:
        return torch.zeros((), device=device)
    sharded = [p.grad for p in params if isinstance(p.grad, DTensor)]
    whole = [p.grad for p in params if not isinstance(p.grad, DTensor)]  # an adopted module's loose tensors
    if sharded and whole:  # beside its sharded submodules (`parallel.loose`): torch norms no mix of the two
        return torch.linalg.vector_norm(torch.stack([_norm(sharded, device), _norm(whole, device)]))
    return _norm(sharded or whole, device)


def _norm(grads: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    from torch.distributed.tensor import DTensor
    from torch.nn.utils import get_total_norm

    norm = get_total_norm(grads)
    if isinstance(norm, DTensor):
        local = norm.to_local()
        if local.device != device:
            norm = DTensor.from_local(local.to(device, non_blocking=True), norm.device_mesh, norm.placements)
        norm = norm.full_tensor()
    return norm.to(device, non_blocking=True)


def clip_grad_norms(optimizer, limits: dict[str, float], global_limit: float | None,
                    device: torch.device | None = None) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """`optimizer`: the modules' `optimizers.ModuleOptimizers`. Each module's pre-clip gradient norm on `device`
    (default: its first parameter's), and the combined one, sqrt(sum of squares). With `global_limit` every module is clipped
    to it by the combined norm; else each module to its own limit (0: none). An offloaded module's CPU gradients
    are scaled by a norm on the accelerator: torch copies that one number to the host (its optimizer steps there
    anyway)."""
    from torch.distributed.tensor import DTensor
    from torch.nn.utils import clip_grads_with_norm_

    optimizer.unscale_()  # fp16: true gradients before norms and clipping
    grads = {name: [p for p in params if p.grad is not None] for name, params in optimizer.params.items()}
    norms = {name: module_grad_norm(params, device or optimizer.params[name][0].device)
             for name, params in grads.items()}
    total = torch.linalg.vector_norm(torch.stack([n.float() for n in norms.values()]))
    for name, params in grads.items():
        limit, norm = (global_limit, total) if global_limit is not None else (limits[name], norms[name])
        if params and limit and limit > 0:
            for sharded in (True, False):  # loose tensors beside sharded ones: torch's foreach takes no mix
                group = [p for p in params if isinstance(p.grad, DTensor) == sharded]
                if group:
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
