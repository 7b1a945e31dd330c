"""The order an adopted model's modules are wrapped in: a module carved out of another's subtree (Qwen2.5-VL's
projector inside its vision tower) is wrapped first, so that the outer module's wrap leaves it to its own
(FSDP2 skips parameters already in a unit or replicated; others are passed as ignored). An FSDP root inside
another module's FSDP root is not a root: the outer one initialises it."""

from __future__ import annotations

from ..modules.units import roots_of


def apply_order(plans: list) -> list:
    """`plans` (the driver's, one per module) with deeper paths first (stable otherwise); marks each root of a
    strategy that shards nested in another such root."""
    roots = {id(item): roots_of(item.slot.module) for item in plans}
    if not any(roots.values()):
        return plans
    outer = [r.path for item in plans if item.strategy.shards for r in roots[id(item)]]
    for item in plans:
        for root in roots[id(item)]:
            root.module.omni_fsdp_nested = item.strategy.shards and any(
                root.path.startswith(path + ".") for path in outer)
    return sorted(plans, key=lambda item: -max((r.depth for r in roots[id(item)]), default=0))
