"""`parallel: none` (and every module when there is no process group): the module runs as it is, each rank on
its own; nothing to sync, its state dict is already full."""

from __future__ import annotations

from ..core.dist import has_process_group
from ..core.errors import OmniArgumentError
from ..core.refusals import RESOLVED, refusal
from .strategy import Strategy, register_strategy


@register_strategy
class NoStrategy(Strategy):
    name = "none"
    description = "the module runs as it is on each rank (every module when there is no process group)"


@refusal(RESOLVED)
def refuse_unwrapped_training(model, args) -> None:
    """A trainable module left unwrapped under a process group trains one copy per rank."""
    if has_process_group() and args.fsdp_scope == "module":
        for name, slot in model.slots.items():
            if slot.args.trainable and slot.args.parallel == "none":
                raise OmniArgumentError(name, "parallel", "`none` under a process group trains one copy per rank: "
                                        "the replicas would diverge and a checkpoint keeps one of them. Use `ddp` or "
                                        "`fsdp`, or `trainable: false`")
