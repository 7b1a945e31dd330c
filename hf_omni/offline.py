"""Offline encoding: a fully frozen module's outputs computed once, cached, and fed to `forward` instead of its
inputs; the module itself then stays on the meta device (never allocated, wrapped, optimised or checkpointed).

    class Captioner(OmniModel):
        @offline_encoder(module="vision", inputs=["pixel_values"], output="image_features")
        def encode_image(self, pixel_values):
            return self.vision(pixel_values=pixel_values).last_hidden_state

        def forward(self, input_ids, pixel_values=None, image_features=None, labels=None, **kw):
            feats = image_features if image_features is not None else self.encode_image(pixel_values)

The cache (`offline_cache.py`) is keyed by source row index; `CachedRows` serves each source row with its
inputs for the module replaced by the cached output, so shuffling and sharding act on source rows and can never
pair a feature with another sample.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch import nn

from .errors import OmniArgumentError


@dataclass(frozen=True)
class OfflineEncoder:
    """What `@offline_encoder` declares: the module, the input columns the method reads, the column it writes."""

    module: str
    inputs: tuple[str, ...]
    output: str
    method: str


def offline_encoder(module: str, inputs: list[str], output: str):
    """Mark an `OmniModel` method as the entry point of frozen module `module`: called with the `inputs` columns
    (batched by the data collator), it returns one output row per input row, stored in column `output`."""
    if not inputs or not all(isinstance(c, str) for c in inputs) or not isinstance(output, str):
        raise ValueError("offline_encoder(module, inputs=[column, ...], output=column): columns are strings")

    def mark(fn):
        import inspect

        named = {n for n, p in inspect.signature(fn).parameters.items() if p.kind != p.VAR_KEYWORD}
        if not set(inputs) <= named:
            raise ValueError(f"offline_encoder(module={module!r}): {fn.__name__} must take each input column as a "
                             f"named parameter; missing {sorted(set(inputs) - named)}")
        @functools.wraps(fn)
        def method(self, *args, **kwargs):
            from .missing_modality import call_entry_point

            return call_entry_point(self, spec, fn, args, kwargs)

        spec = OfflineEncoder(module, tuple(inputs), output, fn.__name__)
        method.offline_encoder = spec
        method.encoder_function = fn  # its source is part of the cache fingerprint
        return method

    return mark


def offline_encoders(model: nn.Module) -> dict[str, OfflineEncoder]:
    """The encoders `model`'s class declares, by module."""
    found: dict[str, OfflineEncoder] = {}
    for name in dir(type(model)):
        spec = getattr(getattr(type(model), name, None), "offline_encoder", None)
        if isinstance(spec, OfflineEncoder):
            if spec.module in found:
                raise ValueError(f"module {spec.module!r} has two offline encoders: {found[spec.module].method} and "
                                 f"{spec.method}")
            found[spec.module] = spec
    return found


def check_offline_modules(model, offline: list[str], module_args: dict) -> dict[str, OfflineEncoder]:
    """Every `offline_modules` entry: a module of `model`, with an `@offline_encoder`, fully frozen."""
    encoders = offline_encoders(model)
    for name in offline:
        if name not in model.module_names:
            raise OmniArgumentError(None, "offline_modules", f"{name!r} is not a module of {type(model).__name__} "
                                    f"{model.module_names}")
        if name not in encoders:
            raise OmniArgumentError(name, "offline_modules", f"{type(model).__name__} declares no "
                                    f"@offline_encoder(module={name!r}, ...) method")
        margs = module_args[name]
        if margs.trainable or margs.lora:
            raise OmniArgumentError(name, "trainable" if margs.trainable else "lora",
                                    "an offline module must be fully frozen (trainable: false, no lora): its cached "
                                    "outputs stand in for it")
    return {name: encoders[name] for name in offline}


def release(module: nn.Module) -> None:
    """Free the module's storage: every parameter and buffer moves to the meta device (the Parameter objects stay;
    their data is dropped). Training from the cache never calls it."""
    module.to("meta")


def is_released(module: nn.Module) -> bool:
    tensors = list(module.parameters()) + list(module.buffers())
    return bool(tensors) and all(t.is_meta for t in tensors)


def every_rank_changes(changed: list[str], group) -> list[str]:
    """What any rank found stale: every rank then encodes, or none does (their collectives must match)."""
    import torch.distributed as dist

    from .dist import has_process_group, world_size

    if not has_process_group():
        return changed
    everyone = [None] * world_size()
    dist.all_gather_object(everyone, changed, group=group)
    return sorted({c for rank_changes in everyone for c in rank_changes})


class CachedRows(torch.utils.data.Dataset):
    """`source` rows with the encoders' inputs dropped and their cached outputs added (`caches`: spec ->
    `offline_cache.Cache`). A row the module had no input for gets no output column (`forward` sees None)."""

    def __init__(self, source, caches: dict):
        self.caches = caches
        self.dropped = {c for spec in caches for c in spec.inputs}
        if hasattr(source, "remove_columns"):  # a datasets.Dataset never reads the dropped columns
            source = source.remove_columns(sorted(self.dropped & set(source.column_names)))
        self.source = source

    def __len__(self):
        return len(self.source)

    def __getitem__(self, index):
        return self.__getitems__([index])[0]

    def __getitems__(self, indices: list[int]) -> list[dict]:
        """A batch's rows (torch's DataLoader fetches through this): each cache read once for all of them."""
        rows = [{k: v for k, v in self.source[i].items() if k not in self.dropped} for i in indices]
        for spec, cache in self.caches.items():
            for row, value in zip(rows, cache.rows(list(indices))):
                if value is not None:
                    row[spec.output] = value
        return rows


def serve_from_caches(model, specs: dict[str, OfflineEncoder], datasets: dict, cache_dir: str, mode: str, collator,
                      batch_size: int, device, output_dir: str | None) -> dict:
    """Each dataset served as `CachedRows`. Per offline module and split: the cache's fingerprint checked; a stale
    or missing cache recomputed (logged) — or, `mode="read_only"`, refused naming what changed — with the module
    materialised once (an `empty_init` module read from its files); then the module's source recorded (one built
    in memory is written to `<output_dir>/frozen/<module>/` first) and the module released."""
    import logging
    import os

    from .checkpoint import write_frozen_source
    from .dist import checkpoint_group
    from .offline_cache import Cache, changes, fingerprint, read_manifest, write_cache
    from .weights import fill_module

    for split, dataset in datasets.items():
        if isinstance(dataset, torch.utils.data.IterableDataset) or not hasattr(dataset, "__getitem__") or \
                not hasattr(dataset, "__len__"):
            raise OmniArgumentError(None, "offline_modules", f"the {split} dataset is {type(dataset).__name__}: "
                                    "offline caches are keyed by row index and need a map-style dataset (a "
                                    "datasets.Dataset or a torch Dataset with __getitem__ and __len__)")
    group = checkpoint_group()
    served: dict[str, dict] = {split: {} for split in datasets}
    for name, spec in specs.items():
        module, folder = getattr(model, name), model.pending_weights.get(name)
        for split, dataset in datasets.items():
            target = os.path.join(cache_dir, f"{name}-{split}")
            want = fingerprint(model, spec, dataset, folder, collator)
            changed = every_rank_changes(changes(read_manifest(target), want, len(dataset)), group)
            if changed:
                if mode == "read_only":
                    raise ValueError(f"offline cache {target} of module {name!r} is not valid ({', '.join(changed)} "
                                     "changed) and offline_cache is read_only")
                logging.getLogger(__name__).warning("module %r: encoding the %s split into %s (%s)", name, split,
                                                    target, ", ".join(changed))
                if model.pending_weights.pop(name, None) is not None:  # empty_init: read once, for encoding
                    fill_module(module, folder, device, name)
                module.to(device).eval()
                write_cache(model, spec, dataset, target, want, collator, batch_size, device, group)
            served[split][spec] = Cache(target, len(dataset))
        entry = model.config.module_entry(name)
        if folder is not None and not entry.get("source"):  # empty_init: the folder it is read from
            entry["source"] = os.path.abspath(folder)
        write_frozen_source(model, name, output_dir, group)  # built in memory: written once, its source
        model.pending_weights.pop(name, None)
        release(module)
    return {split: CachedRows(dataset, served[split]) for split, dataset in datasets.items()}
