"""The interface every parallel strategy implements, and the registry that finds one by its `parallel:` name.

A strategy is applied to one module in place (the module keeps its class and methods) and is then kept in that
module's slot: the driver asks it to turn gradient sync off inside accumulation windows, a checkpoint asks it for
the module's full state, the missing-modality exchange asks whether its forward runs collectives. A new strategy
is a file with a `Strategy` subclass registered with `@register` (built in) or `hf_omni.register_strategy` (`registry`);
nothing else names it.
"""

from __future__ import annotations

import torch
from torch import nn

STRATEGIES: dict[str, type["Strategy"]] = {}


def register(cls: type["Strategy"]) -> type["Strategy"]:
    STRATEGIES[cls.name] = cls
    return cls


def strategy_names() -> tuple[str, ...]:
    """The values `parallel:` accepts."""
    return tuple(STRATEGIES)


class Strategy:
    """How one module (or, under `fsdp_scope: model`, the composed model) runs across ranks."""

    name = ""
    collective = False  # its forward / backward runs collectives that every rank must enter
    shards = False  # it shards parameters (DTensors): an `empty_init` module is sharded on meta, then read

    @classmethod
    def for_module(cls, slot, mesh=None, lazy_init: bool = True) -> "Strategy":
        """The strategy for one module, from its slot's resolved arguments (`mesh`: its device mesh, if it takes
        one; `lazy_init=False`: it is on the meta device until read after wrapping)."""
        return cls()

    def apply(self, module: nn.Module, device: torch.device) -> None:
        """Wrap `module` in place (its class becomes a generated subclass; its methods keep working)."""

    def after_read(self, module: nn.Module) -> None:
        """After an `empty_init` module wrapped on meta (`lazy_init=False`) had its shares read, once every such
        module is read: finish what wrapping left (FSDP2: its roots' lazy init)."""

    def set_gradient_sync(self, enabled: bool) -> None:
        """Off inside a gradient-accumulation window; on for its last micro-step."""

    def full_state_dict(self, module: nn.Module) -> dict[str, torch.Tensor]:
        """`module`'s full state dict (every rank calls this; a sharded one is gathered to rank 0 only, the other
        ranks getting `{}`)."""
        return module.state_dict()
