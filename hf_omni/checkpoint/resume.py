"""Reading a per-module checkpoint back into a prepared composed model (what `ModuleCheckpointer.save` wrote).

    checks (marker, files, module set) -> every module's shapes / dtypes -> weights (each rank its own rows)
    -> optimizer shards (DCP reshards) + optimizer / scheduler JSON -> the Stateful composites -> EMA shadows
    (`state/ema.json`; also for a weights-only load: the best model's EMA) -> GradScaler

Every step some rank does alone ends in an agreement (`core.dist.agreed`), so a rank that fails fails them all.
"""

from __future__ import annotations

import os

from ..core.config import OmniConfig
from ..core.dist import agreed, checkpoint_group, rank, world_size
from ..files.module_folder import module_folder
from ..files.weights import check_through_transformers, read_into, read_through_transformers
from . import bases, contents, module_state


def resume_weights_folders(model, directory: str) -> set[str]:
    """Before `prepare`: modules still on the meta device (`empty_init`) are pointed at the checkpoint (trainable
    ones) or their recorded source (frozen ones) instead of their initial weights. Returns them."""
    pending = [slot for slot in model.slots.values() if slot.is_pending]
    if not pending:
        return set()
    config = OmniConfig.from_pretrained(directory)
    for slot in pending:
        slot.pend(module_folder(directory, config, slot.name))
    return {slot.name for slot in pending}


def check_shared(directory: str, timeout_s: float | None = None) -> dict:
    """`contents.check_complete` with each rank statting its share of the files and parsing their headers / JSON
    (`file_checks`), the ranks then agreeing on the outcome (digests: at the load, `verify_checkpoint`)."""

    with agreed(f"checking checkpoint {directory}", checkpoint_group(timeout_s)):
        return contents.check_complete(directory, share=(rank(), world_size()))


def check(checkpointer, directory: str, weights_only: bool = False) -> dict:
    """Every check of a checkpoint against this model, before anything is loaded (names the module and parameter
    that differ). `weights_only`: a `save_only_model` checkpoint serves too."""
    model = checkpointer.model
    share = (rank(), world_size())  # each rank checks its share of the digests; the ranks then agree
    marker = contents.check_complete(directory, verify=checkpointer.verify, share=share)
    if marker.get("resumable") is False and not weights_only:
        raise ValueError(f"checkpoint {directory} was saved with save_only_model: module weights only, no "
                         "optimizer state; it cannot be resumed (load it with from_pretrained)")
    saved, ours = set(marker["modules"]), set(checkpointer.trainable)
    if saved != ours:
        raise ValueError(f"checkpoint {directory} holds trainable modules {sorted(saved)}, this model trains "
                         f"{sorted(ours)} (missing: {sorted(ours - saved)}, extra: {sorted(saved - ours)})")
    config = OmniConfig.from_pretrained(directory)
    if config.module_names != model.module_names:
        raise ValueError(f"checkpoint {directory} has modules {config.module_names}, the model {model.module_names}")
    return marker


def load(checkpointer, directory: str, optimizer, scheduler, weights_loaded: set[str] = frozenset(),
         weights_only: bool = False) -> None:
    """`ModuleCheckpointer.load`."""
    model, group, trainable = checkpointer.model, checkpointer.group, checkpointer.trainable
    with agreed(f"checking checkpoint {directory}", group):
        marker = check(checkpointer, directory, weights_only)
        for name, base in ({} if weights_only else bases.recorded(directory, marker)).items():
            if name in trainable and checkpointer.states[name].fixed_base and \
                    bases.adopt(base, checkpointer.output_dir, checkpointer.verify):
                checkpointer.bases[name] = base  # the next checkpoints refer to it too: not written again
        config = OmniConfig.from_pretrained(directory)
        folders = {name: module_folder(directory, config, name) for name in model.module_names}
        for name in trainable:
            if folders[name] != checkpointer.folder(directory, name):
                raise ValueError(f"checkpoint {directory}: trainable module {name!r} has no folder of its own")
    saved, emas = {}, {}  # optimizer.json / scheduler.json / ema.json of each module, read before any weights
    for name in trainable:
        with agreed(f"module {name!r}: reading {os.path.join(folders[name], module_state.STATE)}", group):
            saved[name] = None if weights_only else module_state.read_state_json(folders[name])
            emas[name] = module_state.read_ema_json(folders[name])
    todo = {name: folder for name, folder in folders.items()
            if name not in weights_loaded and not model.slots[name].is_offline}  # offline: never read
    masters, metas = {}, {}  # module -> the master weights its state/ holds (read there, not from the rounded HF
    for name in trainable:  # files); its state/'s DCP metadata, read once here for every later reader of it
        with agreed(f"module {name!r}: reading {os.path.join(folders[name], module_state.STATE)}", group):
            metas[name] = state_metadata(checkpointer, name, folders[name], weights_only, emas[name])
            masters[name] = held_masters(checkpointer.states[name], folders[name], metas[name])
    for dry_run in (True, False):  # shapes / dtypes of every module first: nothing half-loaded
        for name, folder in todo.items():
            with agreed(f"module {name!r}: reading {folder}", group):
                read_weights(checkpointer, name, folder, dry_run, masters, metas.get(name))
    for name, slot in model.slots.items():
        slot.entry.source = slot.entry.source or config.module_entry(name).source
    states = checkpointer.states
    if weights_only:  # the unmapped tensors of a save_only_model checkpoint came through transformers above
        for name in trainable:
            if os.path.isdir(os.path.join(folders[name], module_state.STATE)):
                module_state.load_module_tensors(folders[name], states[name].unmapped_tensors(masters[name]),
                                                 metadata=metas[name])
            module_state.restore_ema(name, model.slots[name].ema, folders[name], emas[name], metas[name])  # (best's)
        return
    live = optimizer.templates()  # this rank's shapes of every module's optimizer state
    optimizer.load_state_dict({name: module_state.read_optimizer_state(
        folders[name], live[name], saved[name][0], states[name].unmapped_tensors(masters[name]), metas[name])
        for name in trainable})
    scheduler.load_state_dict({name: saved[name][1] for name in trainable})
    for name in trainable:  # `ema`: shadows and counter (or, from a checkpoint without, the loaded weights)
        module_state.restore_ema(name, model.slots[name].ema, folders[name], emas[name], metas[name])
    contents.load_scaler(optimizer.scaler, directory)


def state_metadata(checkpointer, name: str, folder: str, weights_only: bool, ema_saved: dict | None):
    """DCP's metadata of the module's `folder/state/`, read once a resume (rank 0 reads the headers, every rank
    receives them: `module_state.state_metadata`) and passed to each later reader of it; None without a `state/`,
    or for a weights-only load that reads no tensor there (no masters, unmapped tensors or EMA to restore)."""
    state, ema = checkpointer.states[name], checkpointer.model.slots[name].ema
    if not os.path.isdir(os.path.join(folder, module_state.STATE)) or weights_only and not (
            state.masters or state.unmapped or (ema is not None and ema_saved is not None)):
        return None
    return module_state.state_metadata(folder)


def held_masters(state, folder: str, metadata=None) -> frozenset[str]:
    """The module's master weights that `folder/state/` holds (`metadata`: its DCP metadata, else read here). A
    checkpoint of a run that kept them as loaded (another `master_dtype`) holds none: they start from its HF files,
    cast up."""
    if not state.masters or not os.path.isdir(os.path.join(folder, module_state.STATE)):
        return frozenset()
    kept = set(module_state.state_keys(folder, metadata))
    return frozenset(n for n in state.masters if f"tensors.{n}" in kept)


def read_weights(checkpointer, name: str, folder: str, dry_run: bool, masters: dict, metadata=None) -> None:
    """A trainable module from its checkpoint folder (what the HF files cannot serve comes from `state/`: the
    unmapped tensors, and the master weights it holds, `masters[name]`; `metadata`: its `state/`'s); a frozen one
    from its source (through transformers' loading for what the files do not hold as is). A tensor that cannot be
    restored is an error naming the module and tensor."""
    state = checkpointer.states[name]
    module, unmapped = checkpointer.model.slots[name].module, state.unmapped
    if name in checkpointer.trainable and os.path.isdir(os.path.join(folder, module_state.STATE)):  # (else: as a
        kept = set(module_state.state_keys(folder, metadata)) if dry_run and unmapped else set()
        lost = [n for n in sorted(unmapped) if dry_run and f"tensors.{n}" not in kept]
        if lost:
            raise ValueError(f"module {name!r}: {folder}/{module_state.STATE} lacks {len(lost)} tensors {lost[:5]}")
        read_into(module, folder, strict=True, module_name=name, dry_run=dry_run, skip=unmapped | masters[name],
                  replicated=True)
        return
    missing = read_into(module, folder, module_name=name, dry_run=dry_run, replicated=True)
    lost = [n for n in missing if n not in unmapped]
    if lost:
        raise ValueError(f"module {name!r}: {folder} cannot restore {len(lost)} tensors {lost[:5]}")
    if missing and dry_run:  # refused above the limit for whole copies before anything is read
        check_through_transformers(module, missing, name)
    if missing and not dry_run:
        lost = read_through_transformers(module, folder, missing, name)
        if lost:
            raise ValueError(f"module {name!r}: {folder} cannot restore {len(lost)} tensors {lost[:5]}")
