"""`parallel: none` (and every module when there is no process group): the module runs as it is, each rank on
its own; nothing to sync, its state dict is already full."""

from __future__ import annotations

from .strategy import Strategy, register


@register
class NoStrategy(Strategy):
    name = "none"
    description = "the module runs as it is on each rank (every module when there is no process group)"
