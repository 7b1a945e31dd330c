"""Offline encoding: a fully frozen module's outputs computed once, cached, and fed to `forward` instead of its
inputs; the module itself then stays on the meta device (never allocated, wrapped, optimised or checkpointed).

    class Captioner(OmniModel):
        @offline_encoder(module="vision", inputs=["pixel_values"], output="image_features")
        def encode_image(self, pixel_values):
            return self.vision(pixel_values=pixel_values).last_hidden_state

        def forward(self, input_ids, pixel_values=None, image_features=None, labels=None, **kw):
            feats = image_features if image_features is not None else self.encode_image(pixel_values)

The decorated method is the module's entry point, cached or not (`missing_modality.py` runs it on every rank).
The cache (`cache.py`) is keyed by source row index; `serve.CachedRows` serves each source row with its inputs
for the module replaced by the cached output, so shuffling and sharding act on source rows and can never pair a
feature with another sample.
"""

from __future__ import annotations

import functools
import inspect

from ..core.errors import OmniArgumentError
from ..core.refusals import RESOLVED, refusal
from .missing_modality import call_entry_point
from .spec import RAGGED, OfflineEncoder, offline_encoders


def offline_encoder(module: str, inputs: list[str], output: str, ragged: str | None = None,
                    items: str | None = None):
    """Mark an `OmniModel` method as the entry point of frozen module `module`: called with the `inputs` columns
    (batched by the data collator), it returns one output row per input row, stored in column `output`.

    Outputs of different lengths (`ragged`), as transformers returns them: `"tuple"`, a tuple of per-item tensors
    (Qwen2.5-VL's `get_image_features(...).pooler_output`), or `"concat"`, `(values, sizes)`: one tensor, items
    concatenated along dim 0, and each item's length. `items`: the input column whose first dimension counts a
    row's items (`image_grid_thw`: one row per image); without it, one item per row. The cache keeps each row's
    items and serves a batch's in the same form."""
    if not inputs or not all(isinstance(c, str) for c in inputs) or not isinstance(output, str):
        raise ValueError("offline_encoder(module, inputs=[column, ...], output=column): columns are strings")
    if ragged not in (None, *RAGGED):
        raise ValueError(f"offline_encoder(module={module!r}): ragged must be one of {RAGGED} or None, got {ragged!r}")
    if items is not None and (ragged is None or items not in inputs):
        raise ValueError(f"offline_encoder(module={module!r}): items={items!r} names the input column counting a "
                         "row's items of a ragged output; it must be one of inputs, with ragged set")

    def mark(fn):
        named = {n for n, p in inspect.signature(fn).parameters.items() if p.kind != p.VAR_KEYWORD}
        if not set(inputs) <= named:
            raise ValueError(f"offline_encoder(module={module!r}): {fn.__name__} must take each input column as a "
                             f"named parameter; missing {sorted(set(inputs) - named)}")

        @functools.wraps(fn)
        def method(self, *args, **kwargs):
            return call_entry_point(self, spec, fn, args, kwargs)

        spec = OfflineEncoder(module, tuple(inputs), output, fn.__name__, ragged, items)
        method.offline_encoder = spec
        method.encoder_function = fn  # its source is part of the cache fingerprint
        return method

    return mark


@refusal(RESOLVED)
def refuse_offline_modules(model, args) -> None:
    check_offline_modules(model, list(args.offline_modules or []))


def check_offline_modules(model, offline: list[str]) -> None:
    """Every `offline_modules` entry: a module of `model`, with an `@offline_encoder`, fully frozen (its slot's
    resolved arguments); each one's slot gets its encoder."""
    adopted = model.encoders_from_settings
    for slot in model.slots.values():
        if not adopted and getattr(slot.args, "offline_encoder", None):
            raise OmniArgumentError(slot.name, "offline_encoder", "names an adopted model's method (`from_model`); "
                                    "a composed model declares its entry point with @offline_encoder")
    encoders = offline_encoders(model)
    for name in offline:
        if name not in model.module_names:
            raise OmniArgumentError(None, "offline_modules", f"{name!r} is not a module of {type(model).__name__} "
                                    f"{model.module_names}")
        if name not in encoders:
            raise OmniArgumentError(name, "offline_modules", f"set modules.{name}.offline_encoder (the released "
                                    "model's get_image_features)" if adopted else f"{type(model).__name__} declares "
                                    f"no @offline_encoder(module={name!r}, ...) method")
        margs = model.slots[name].args
        if margs.trainable or margs.lora:
            raise OmniArgumentError(name, "trainable" if margs.trainable else "lora",
                                    "an offline module must be fully frozen (trainable: false, no lora): its cached "
                                    "outputs stand in for it")
    for slot in model.slots.values():
        slot.encoder = encoders[slot.name] if slot.name in offline else None
