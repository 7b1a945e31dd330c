"""What `@offline_encoder` declares about a module's entry point, and finding the declarations of a model class."""

from __future__ import annotations

import functools
from dataclasses import dataclass

RAGGED = ("tuple", "concat")


@dataclass(frozen=True)
class OfflineEncoder:
    """The module, the input columns the method reads, the column it writes, the method's name; for outputs of
    different lengths per item (a Qwen2.5-VL tower's tokens per image), their form (`ragged`: "tuple" of per-item
    tensors, or "concat": `(values, sizes)`) and the input column whose first dimension counts a row's items
    (`items`; None: one item per row). `keeps`: inputs the model's forward reads too (Qwen2.5-VL's `image_grid_thw`,
    for its position ids), served beside the cached output instead of dropped."""

    module: str
    inputs: tuple[str, ...]
    output: str
    method: str
    ragged: str | None = None
    items: str | None = None
    keeps: tuple[str, ...] = ()

    @property
    def dropped(self) -> tuple[str, ...]:
        """The input columns a served row no longer has (its cached output stands in for them)."""
        return tuple(c for c in self.inputs if c not in self.keeps)


@functools.cache
def class_encoders(cls) -> tuple[OfflineEncoder, ...]:
    """The `@offline_encoder` specs a model class declares (looked up once per class)."""
    return tuple(spec for name in dir(cls) if isinstance(spec := getattr(getattr(cls, name, None), "offline_encoder",
                                                                         None), OfflineEncoder))


def offline_encoders(model) -> dict[str, OfflineEncoder]:
    """The encoders of `model`, by module (`model.offline_encoder_specs()`: an adopted model's come from settings)."""
    return model.offline_encoder_specs()


def declared_encoders(cls) -> dict[str, OfflineEncoder]:
    """The encoders a model class declares, by module (two for one module: an error)."""
    found: dict[str, OfflineEncoder] = {}
    for spec in class_encoders(cls):
        if spec.module in found:
            raise ValueError(f"module {spec.module!r} has two offline encoders: {found[spec.module].method} and "
                             f"{spec.method}")
        found[spec.module] = spec
    return found
