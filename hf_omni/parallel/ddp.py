"""`parallel: ddp`: data parallel in place with torch's composable `replicate` (DDP's bucketed all-reduce, no
wrapper object: `model.llm` keeps its class, as a generated `DDP...` subclass, and its methods).

Composable `replicate` builds its DDP over the parameters alone, so it never syncs buffers; with DDP's
`broadcast_buffers` (Trainer's default) hf_omni broadcasts the module's state buffers from rank 0 before each
forward, as `DistributedDataParallel` does: BatchNorm running statistics agree across ranks at every step and in
evaluation. Non-persistent buffers (`register_buffer(..., persistent=False)`: a rotary embedding's `inv_freq`,
position ids) are not state — no checkpoint holds them, each rank derives them — so they are broadcast once, when
the module is wrapped (every rank starts from rank 0's, whatever it was built with), and not before each forward
(`DistributedDataParallel` broadcasts them every time: a collective per forward for nothing).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from ..compat import composable_replicate
from ..modules.units import roots_of, run_roots
from .loose import replicate_loose
from .strategy import Strategy, register_strategy


@register_strategy
class DdpStrategy(Strategy):
    """Replicated over all ranks with DDP's keyword arguments (`find_unused_parameters`, `bucket_cap_mb`, ...)."""

    name = "ddp"
    description = "replicated on every rank with DDP's bucketed all-reduce (torch's composable `replicate`)"
    collective = True

    def __init__(self, ddp_kwargs: dict, module_name: str = ""):
        super().__init__(module_name)
        self.ddp_kwargs = dict(ddp_kwargs)
        self.module: nn.Module | None = None
        self.loose = None  # an adopted module's paths that name tensors (`loose.py`)

    @classmethod
    def for_module(cls, slot, mesh=None, lazy_init: bool = True, meshes=None) -> "DdpStrategy":
        return cls(slot.args.ddp_kwargs(), slot.name)

    def apply(self, module: nn.Module, device: torch.device) -> None:
        """Initialised now: parameters are broadcast from rank 0 before any method of the module runs (the composed
        forward may call `get_input_embeddings()` before the module's own forward)."""
        for root, carved in units(module):  # an adopted model's module: each of its released submodules
            composable_replicate(root, device, self.ddp_kwargs, ignored_modules=carved)
            skip = {id(b) for c in carved for b in c.buffers()}
            every = [b for b in root.buffers() if b.numel() and id(b) not in skip]
            state = {id(b) for b in state_buffers(root)}
            buffers = [b for b in every if id(b) in state]
            if self.ddp_kwargs.get("broadcast_buffers", True) and every:
                broadcast_buffers(every)
                if buffers:
                    root.register_forward_pre_hook(lambda mod, args, buffers=buffers: broadcast_buffers(buffers))
        self.loose = replicate_loose(module)
        self.module = module

    def set_gradient_sync(self, enabled: bool) -> None:
        """Skipped inside a window unless the module's `sync_each_batch` is true (then it all-reduces every
        micro-step: whole gradients either way, so syncing late only saves the collectives)."""
        for root in run_roots(self.module):
            root.set_requires_gradient_sync(enabled or self.sync_each_batch)
        if self.loose is not None:
            self.loose.syncing = enabled


def units(module: nn.Module) -> list[tuple[nn.Module, list[nn.Module]]]:
    """(what is replicated, its submodules left to other modules) for a module or each root of a rooted one."""
    return [(r.module, r.carved_modules()) for r in roots_of(module)] or [(module, [])]


def state_buffers(module: nn.Module) -> list[torch.Tensor]:
    """The persistent buffers of `module` and its submodules (those its `state_dict` holds), each once."""
    seen, found = set(), []
    for owner in module.modules():
        for name, buffer in owner.named_buffers(recurse=False):
            if name not in owner._non_persistent_buffers_set and id(buffer) not in seen:
                seen.add(id(buffer))
                found.append(buffer)
    return found


def broadcast_buffers(buffers: list[torch.Tensor]) -> None:
    """Rank 0's values into every rank's buffers, one collective per dtype."""
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for buf in buffers:
        by_dtype.setdefault(buf.dtype, []).append(buf)
    for group in by_dtype.values():
        flat = torch.cat([b.detach().reshape(-1) for b in group])
        dist.broadcast(flat, src=0)
        offset = 0
        with torch.no_grad():
            for buf in group:
                buf.copy_(flat[offset:offset + buf.numel()].view_as(buf))
                offset += buf.numel()
