"""Declaring a settings key once, as a dataclass field whose metadata carries its types, nullability, bounds,
choices and help (as Accelerate's plugin dataclasses do), and checking a value against that declaration."""

from __future__ import annotations

from dataclasses import MISSING, field, fields
from typing import Any

from .errors import OmniArgumentError

NUMBER = (int, float)


def key(default: Any, types: tuple, help: str, *, nullable: bool = False, minimum: float | None = None,
        choices=None, check=None, top_level: str | None = "same") -> Any:
    """Declare a per-module (or `fsdp_plugin`) key. `choices`: a tuple or a callable returning one; `check(module,
    value)`: a deeper validation; `top_level`: the OmniTrainingArguments attribute that is every module's default
    (None: per-module only)."""
    metadata = {"key": True, "types": types, "help": help, "nullable": nullable, "minimum": minimum,
                "choices": choices, "check": check, "top_level": top_level}
    if isinstance(default, (dict, list)):
        return field(default_factory=lambda: type(default)(default), metadata=metadata)
    return field(default=default, metadata=metadata)


def merge_overlay(base: Any, overlay: Any) -> Any:
    """Dicts merge key by key (recursively); lists and scalars replace; `None` removes the inherited value."""
    if isinstance(base, dict) and isinstance(overlay, dict):
        out = dict(base)
        for name, value in overlay.items():
            if value is None:
                out.pop(name, None)
            else:
                out[name] = merge_overlay(base.get(name), value)
        return out
    return overlay


def as_number(module: str | None, name: str, value: Any) -> Any:
    """YAML reads `1e-4` as a string: accept numeric strings for numeric keys."""
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            raise OmniArgumentError(module, name, f"expected a number, got {value!r}") from None
    return value


def check_type(module: str | None, name: str, value: Any, types: tuple) -> None:
    names = "/".join("null" if t is type(None) else t.__name__ for t in types)
    if (isinstance(value, bool) and bool not in types) or not isinstance(value, types):
        raise OmniArgumentError(module, name, f"expected {names}, got {type(value).__name__} {value!r}")


def check_field(module: str | None, name: str, value: Any, meta: dict) -> Any:
    """Validate one declared key's value (coercing numeric strings); returns the value to use."""
    if value is None:
        if not meta["nullable"]:
            raise OmniArgumentError(module, name, "null only removes dict or optional values")
        return None
    if meta["types"] is NUMBER or set(NUMBER) <= set(meta["types"]):
        value = as_number(module, name, value)
    check_type(module, name, value, meta["types"])
    if meta["minimum"] is not None and value < meta["minimum"]:
        raise OmniArgumentError(module, name, f"must be >= {meta['minimum']}, got {value}")
    choices = meta["choices"]() if callable(meta["choices"]) else meta["choices"]
    if choices is not None and value not in choices:
        raise OmniArgumentError(module, name, f"must be one of {tuple(choices)}, got {value!r}")
    if meta["check"] is not None:
        meta["check"](module, value)
    return value


def declared(cls) -> dict[str, Any]:
    """The declared keys of `cls`: name -> dataclass field."""
    return {f.name: f for f in fields(cls) if f.metadata.get("key")}


def default_of(f) -> Any:
    return f.default_factory() if f.default_factory is not MISSING else f.default
