"""The order an adopted model's modules are wrapped in: a module carved out of another's subtree (Qwen2.5-VL's
projector inside its vision tower) is wrapped first, so that the outer module's wrap leaves it to its own
(FSDP2 skips parameters already in a unit or replicated; others are passed as ignored). An FSDP root inside
another module's FSDP root is not a root: the outer one initialises it."""

from __future__ import annotations

from ..modules.units import roots_of


def apply_order(slots: list, kinds: dict[str, str]) -> list:
    """`slots` with deeper paths first (stable otherwise); marks each FSDP root nested in another's."""
    roots = {slot.name: roots_of(slot.module) for slot in slots}
    if not any(roots.values()):
        return slots
    outer = [r.path for name, rs in roots.items() if kinds.get(name) == "fsdp" for r in rs]
    for name, rs in roots.items():
        for root in rs:
            root.module.omni_fsdp_nested = kinds.get(name) == "fsdp" and any(
                root.path.startswith(path + ".") for path in outer)
    return sorted(slots, key=lambda slot: -max((r.depth for r in roots[slot.name]), default=0))
