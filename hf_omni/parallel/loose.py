"""A module's paths that name one parameter or buffer (BLIP-2's `query_tokens`), under a strategy that spans ranks:
kept whole on every rank beside the module's sharded or replicated submodules.

Not sharded: FSDP2's `fully_shard` registers a sharded parameter on the modules of the subtree it wraps and gathers
it in that subtree's forward hooks. A tensor held by the released model's root (or any submodule that is no path) has
no subtree of its own to wrap: wrapping the Part would leave the released holder the unsharded original (what its
forward reads, never trained), and wrapping the holder would shard every other module's tensors under it. So it
is replicated as DDP replicates: rank 0's values at wrap, and its gradient averaged over the ranks once each
backward ends (after the module's own reductions, in the same order on every rank)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from ..compat import queue_backward_callback
from ..modules.units import loose_tensors


class LooseReplicas:
    """The loose tensors of one rooted module (`modules.units.loose_tensors`), replicated over every rank."""

    def __init__(self, part: nn.Module):
        self.loose, self.syncing, self.queued = list(loose_tensors(part)), True, False
        self.hooked: dict[int, nn.Parameter] = {}
        live = [t for t in self.tensors() if not t.is_meta]  # empty_init: every rank reads the same values later
        with torch.no_grad():
            for tensor in live:
                dist.broadcast(tensor.data, src=0)
        self.attach()
        holders = {id(loose.holder): loose.holder for loose in self.loose}
        for holder in holders.values():  # a meta tensor's allocation gives it a new parameter: hooked at its first use
            holder.register_forward_pre_hook(lambda *_: self.attach())

    def tensors(self) -> list[torch.Tensor]:
        return [loose.tensor for loose in self.loose]

    @property
    def params(self) -> list[nn.Parameter]:
        return [t for t in self.tensors() if isinstance(t, nn.Parameter) and t.requires_grad]

    def attach(self) -> None:
        for param in self.params:
            if self.hooked.get(id(param)) is not param:
                self.hooked[id(param)] = param
                param.register_post_accumulate_grad_hook(self._ready)

    def _ready(self, param) -> None:
        if self.syncing and not self.queued:
            self.queued = True
            queue_backward_callback(self._reduce)

    def _reduce(self) -> None:
        """Every loose gradient averaged over the ranks (one all-reduce per dtype)."""
        self.queued = False
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for param in self.params:
            if param.grad is not None:
                by_dtype.setdefault(param.grad.dtype, []).append(param.grad)
        for grads in by_dtype.values():
            flat = torch.cat([g.reshape(-1) for g in grads])
            dist.all_reduce(flat)
            flat /= dist.get_world_size()
            offset = 0
            for grad in grads:
                grad.copy_(flat[offset:offset + grad.numel()].view_as(grad))
                offset += grad.numel()


def replicate_loose(module: nn.Module) -> LooseReplicas | None:
    """Replicas of `module`'s loose tensors (an adopted model's module with paths naming tensors), else None."""
    return LooseReplicas(module) if loose_tensors(module) else None
