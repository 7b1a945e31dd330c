"""Datasets served from offline caches: each source row with the encoders' inputs dropped and their cached outputs
added (`CachedRows`), after encoding whatever cache is missing or stale (`serve_from_caches`); the module is then
released to the meta device."""

from __future__ import annotations

import logging
import os

import torch
import torch.distributed as dist

from ..core.dist import agreed, broadcast_from_main, checkpoint_group, has_process_group, is_main, world_size
from ..core.errors import OmniArgumentError
from ..files.folder import write_frozen_source
from ..files.weights import fill_module
from .cache import Cache, changes, fingerprint, read_manifest, write_cache

ENCODE_ONLY = "HF_OMNI_ENCODE_ONLY"  # set by `hf-omni encode`: OmniTrainer.train() encodes, then the run ends


def every_rank_changes(changed: list[str], group) -> list[str]:
    """What any rank found stale: every rank then encodes, or none does (their collectives must match)."""
    if not has_process_group():
        return changed
    everyone = [None] * world_size()
    dist.all_gather_object(everyone, changed, group=group)
    return sorted({c for rank_changes in everyone for c in rank_changes})


class CachedRows(torch.utils.data.Dataset):
    """`source` rows with the encoders' inputs dropped and their cached outputs added (`caches`: spec ->
    `cache.Cache`). A row the module had no input for gets no output column (`forward` sees None)."""

    def __init__(self, source, caches: dict):
        self.caches = caches
        self.dropped = {c for spec in caches for c in spec.dropped}
        if hasattr(source, "remove_columns"):  # a datasets.Dataset never reads the dropped columns
            source = source.remove_columns(sorted(self.dropped & set(source.column_names)))
        self.source = source

    def __len__(self):
        return len(self.source)

    @property
    def modalities(self):
        """The source's `modalities` (`group_by_modality`): a row has a cached output where it had the inputs."""
        return getattr(self.source, "modalities", None)

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


def serve_from_caches(model, datasets: dict, cache_dir: str, mode: str, collator, batch_size: int, device,
                      output_dir: str | None, timeout_s: float | None = None) -> dict:
    """Each dataset served as `CachedRows`. Per offline module (a slot with an `encoder`) and split: the cache's
    fingerprint checked; a stale or missing cache recomputed (logged) — or, `mode="read_only"`, refused naming what
    changed — with the module read whole once (an `empty_init` module, from its files); then the module's source
    recorded (one built in memory is written to `<output_dir>/frozen/<module>/` first) and the module released."""
    for split, dataset in datasets.items():
        if isinstance(dataset, torch.utils.data.IterableDataset) or not hasattr(dataset, "__getitem__") or \
                not hasattr(dataset, "__len__"):
            raise OmniArgumentError(None, "offline_modules", f"the {split} dataset is {type(dataset).__name__}: "
                                    "offline caches are keyed by row index and need a map-style dataset (a "
                                    "datasets.Dataset or a torch Dataset with __getitem__ and __len__)")
    group = checkpoint_group(timeout_s)
    served: dict[str, dict] = {split: {} for split in datasets}
    for slot in [s for s in model.slots.values() if s.encoder is not None]:
        name, spec, folder = slot.name, slot.encoder, slot.weights
        for split, dataset in datasets.items():
            target = os.path.join(cache_dir, f"{name}-{split}")
            with agreed(f"module {name!r}: fingerprinting the {split} split", group):  # rank 0 hashes, once
                want = fingerprint(model, spec, dataset, folder, collator) if is_main() else None
            want = broadcast_from_main(want, group)
            changed = every_rank_changes(changes(read_manifest(target), want, len(dataset)), group)
            if changed:
                if mode == "read_only":
                    raise ValueError(f"offline cache {target} of module {name!r} is not valid ({', '.join(changed)} "
                                     "changed) and offline_cache is read_only")
                logging.getLogger(__name__).warning("module %r: encoding the %s split into %s (%s)", name, split,
                                                    target, ", ".join(changed))
                if slot.is_pending:  # empty_init: read once, for encoding
                    fill_module(slot.module, folder, device, name)
                    slot.filled()
                slot.module.to(device).eval()
                write_cache(model, spec, dataset, target, want, collator, batch_size, device, group)
            served[split][spec] = Cache(target, len(dataset), ragged=spec.ragged is not None)
        if folder is not None:  # empty_init: the folder it is read from is its source
            slot.record_source(folder)
        write_frozen_source(slot, output_dir, group)  # built in memory: written once, its source
        unkernelize_holders(model, slot.module)
        slot.go_offline()
    return {split: CachedRows(dataset, served[split]) for split, dataset in datasets.items()}


def unkernelize_holders(model, module) -> None:
    """transformers (5.25+, with `kernels`) kernelizes a `from_pretrained` model again at every `train()` / `eval()`
    switch, on its first parameter's device: a model holding a module about to move to the meta device (its own, or
    an adopted release holding the tower) is set back to torch's layers first, while its device is still real."""
    owned = {id(p) for p in module.parameters()}
    for holder in model.forward_owner().modules():
        if getattr(holder, "use_kernels", False) and any(id(p) in owned for p in holder.parameters()):
            logging.getLogger(__name__).info("%s: transformers' kernels reset to torch's layers (a module of it is "
                                             "served offline, on the meta device)", type(holder).__name__)
            holder.use_kernels = False
