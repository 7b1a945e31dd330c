"""What a rank holds of a module's gradients: the storage behind every parameter's `.grad` (a DTensor's local
shard) and behind the whole gradients FSDP2 keeps inside an accumulation window without sync (its unsharded
parameters' `.grad`, or the fp32 `unsharded_accumulated_grad` under mixed precision). Storage is counted once, in
full: a sharded gradient that is a view of the reduce-scatter's output counts that output. Reads FSDP2 internals
(tests only); `sample_after_backward` records it after every micro-step of a Trainer."""

from __future__ import annotations

import torch


def held_gradient_bytes(module: torch.nn.Module) -> int:
    from torch.distributed.fsdp import FSDPModule

    seen, total = set(), 0

    def add(tensor):
        nonlocal total
        if tensor is None:
            return
        local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
        storage = local.untyped_storage()
        if storage.data_ptr() not in seen and storage.nbytes():
            seen.add(storage.data_ptr())
            total += storage.nbytes()

    for param in module.parameters():
        add(param.grad)
    for unit in module.modules():
        if isinstance(unit, FSDPModule):
            for group in unit._get_fsdp_state()._fsdp_param_groups:
                for fsdp_param in group.fsdp_params:
                    add(fsdp_param.sharded_param.grad)
                    add(getattr(fsdp_param, "unsharded_accumulated_grad", None))
                    unsharded = getattr(fsdp_param, "_unsharded_param", None)
                    add(unsharded.grad if unsharded is not None else None)
    return total


def sample_after_backward(trainer, modules: dict[str, torch.nn.Module]) -> dict[str, list[int]]:
    """Wrap `trainer.training_step` so that each micro-step's backward is followed by a sample of every module's
    held gradient bytes; returns the lists it fills."""
    samples: dict[str, list[int]] = {name: [] for name in modules}
    step = trainer.training_step

    def sampled(*args, **kwargs):
        out = step(*args, **kwargs)
        for name, module in modules.items():
            samples[name].append(held_gradient_bytes(module))
        return out

    trainer.training_step = sampled
    return samples
