"""`ModuleCheckpointer`: saves and loads the per-module state of a prepared composed model.

    save:  remove a stale marker -> frozen sources (once) -> per trainable module: HF folder (rank 0, gathered) +
           optimizer shards (DCP, every rank) + scheduler -> root config.json -> [async: later] every rank done ->
           marker (rank 0, atomic)
    load:  checks (marker, files, module set) -> every module's shapes / dtypes -> weights (each rank its own rows)
           -> optimizer shards (DCP reshards) + scheduler

The layout is in `checkpoint_files`. RNG and data position stay the loop's (OmniTrainer writes every rank's RNG
state through `rng.py`; a custom loop uses `accelerator.save_state`)."""

from __future__ import annotations

import atexit
import concurrent.futures
import os
import shutil

from . import checkpoint_files as files
from . import module_state
from .config import OmniConfig, module_folder
from .dist import agreed, checkpoint_group, is_main
from .module_io import save_module
from .offline import is_released
from .parallel import full_state_dict
from .progress import each
from .save_pipeline import SavePipeline
from .weights import file_layout, module_tensors, read_into, read_through_transformers


def resume_weights_folders(model, directory: str) -> set[str]:
    """Before `prepare`: modules still on the meta device (`empty_init`) are pointed at the checkpoint (trainable
    ones) or their recorded source (frozen ones) instead of their initial weights. Returns them."""
    if not model.pending_weights:
        return set()
    config = OmniConfig.from_pretrained(directory)
    for name in model.pending_weights:
        model.pending_weights[name] = module_folder(directory, config, name)
    return set(model.pending_weights)


def write_frozen_source(model, name: str, output_dir: str | None, group) -> None:
    """A fully frozen module with no source (built in memory) is written once to <output_dir>/frozen/<module>/,
    which becomes its recorded source (every rank calls this)."""
    entry = model.config.module_entry(name)
    if entry.get("source"):
        return
    if not output_dir:
        raise ValueError(f"module {name!r} is frozen and was built in memory: saving it needs an output_dir "
                         "(args.output_dir, or OmniPlugin(output_dir=...))")
    folder = os.path.abspath(os.path.join(output_dir, "frozen", name))
    module = getattr(model, name)
    state = full_state_dict(module)
    with agreed(f"module {name!r}: writing {folder}", group):
        if is_main():
            save_module(module, folder, state, model.processors.get(name))
    entry["source"] = folder


class ModuleCheckpointer:
    """Per-module checkpoints of `model`: `trainable` modules write a folder each; frozen ones are recorded by
    source (a module built in memory is written once to `<output_dir>/frozen/<module>/`)."""

    def __init__(self, model, trainable: list[str], output_dir: str | None, save_async: bool, verify: bool = False,
                 show_progress: bool = True):
        self.model, self.trainable, self.show_progress = model, list(trainable), show_progress
        self.output_dir, self.save_async, self.verify = output_dir, save_async, verify
        self._pending: tuple | None = None  # (directory, step, futures, resumable) of a save without its marker
        self.pipeline = SavePipeline() if save_async else None  # the one background thread of async saves
        self._stagers: dict = {}  # module -> DCP stager reused by async saves
        self._exit_hook = False
        self._unmapped: dict[str, frozenset[str]] = {}
        self.group = checkpoint_group()  # every step one rank does alone ends in an agreement on this group
        self.async_group = checkpoint_group() if save_async else None  # the background writer's collectives
        self.on_marked = None  # called with a checkpoint's folder on rank 0 once its marker is written (Hub push)

    def unmapped(self, name: str) -> frozenset[str]:
        """Tensors of module `name` its HF files do not hold as is: a checkpoint keeps them in `state/`."""
        if name not in self._unmapped:
            module = getattr(self.model, name)
            layout = file_layout(module)
            self._unmapped[name] = frozenset(n for n in module_tensors(module) if n not in layout)
        return self._unmapped[name]

    def _unmapped_tensors(self, name: str) -> dict:
        tensors = module_tensors(getattr(self.model, name))
        return {n: tensors[n].detach() for n in sorted(self.unmapped(name))}

    # -- save -------------------------------------------------------------------------------------
    def save(self, directory: str, optimizer, scheduler, step: int | None = None, write_marker: bool = True,
             weights_only: bool = False) -> None:
        """Every rank: module folders, optimizer shards and schedulers, the root `config.json`; the marker after
        every rank finished every file (with `save_async`, at the next save or `wait()`). `weights_only`
        (Trainer's `save_only_model`): module folders without `state/`, marked not resumable."""
        self.wait()
        with agreed(f"preparing {directory}", self.group):
            if is_main():
                os.makedirs(directory, exist_ok=True)
                stale = os.path.join(directory, files.MARKER)
                if os.path.exists(stale):  # a re-save into this folder: incomplete until the new marker is written
                    os.remove(stale)
                    files.fsync_dir(directory)
                for name in self.trainable:  # old shards would be read back beside the new ones
                    subfolder = self.model.config.module_entry(name)["subfolder"]
                    shutil.rmtree(os.path.join(directory, subfolder, module_state.STATE), ignore_errors=True)
        self.write_frozen_sources()
        pipeline = self.pipeline
        if pipeline is not None:
            pipeline.begin([getattr(self.model, name) for name in self.trainable])
        for name in each(self.trainable, f"saving {directory}", enabled=self.show_progress and pipeline is None):
            module = getattr(self.model, name)
            folder = os.path.join(directory, self.model.config.module_entry(name)["subfolder"])
            state = full_state_dict(module)
            with agreed(f"module {name!r}: writing {folder}", self.group):
                if is_main():
                    save_module(module, folder, state, self.model.processors.get(name), pipeline=pipeline)
            if weights_only:
                continue
            optim_tensors, optim_rest = module_state.optimizer_state(module, optimizer.optimizers[name], folder)
            with agreed(f"module {name!r}: writing {os.path.join(folder, module_state.STATE)} "
                        f"({module_state.OPTIMIZER}, {module_state.SCHEDULER})", self.group):
                if is_main():
                    module_state.save_json(optim_rest, folder, module_state.OPTIMIZER)
                    module_state.save_scheduler(scheduler.schedulers[name], folder)
            stager = self._stagers.setdefault(name, module_state.make_stager()) if pipeline is not None else None
            module_state.save_state_tensors(folder, optim_tensors, self._unmapped_tensors(name), stager=stager,
                                            pipeline=pipeline, group=self.async_group)
        with agreed(f"writing {os.path.join(directory, 'config.json')}", self.group):
            if is_main():
                self.model.write_config(directory)
                if not weights_only:
                    files.save_scaler(optimizer.scaler, directory)
        futures = pipeline.start(self.async_group) if pipeline is not None else []
        self._pending = (directory, step, futures, not weights_only)
        if futures and not self._exit_hook:  # process exit waits for shards still being written
            atexit.register(lambda: [f.result() for f in (self._pending or (None, None, [], None))[2]])
            self._exit_hook = True
        if write_marker and not self.save_async:
            self.wait()

    def fence(self) -> None:
        """Before an optimizer step: the async save in flight has copied what it writes."""
        if self.pipeline is not None:
            self.pipeline.fence()

    def wait(self) -> None:
        """Finish the save in flight: wait for its files on every rank, then write its marker (rank 0)."""
        if self._pending is None:
            return
        directory, step, futures, resumable = self._pending
        self._pending = None
        concurrent.futures.wait(futures)  # every job done (a failed one does not stop the later ones)
        with agreed(f"writing checkpoint {directory}", self.group):
            for future in futures:
                future.result()
        with agreed(f"writing {os.path.join(directory, files.MARKER)}", self.group):
            if is_main():
                files.write_marker(directory, files.marker_info(directory, step, self.trainable, resumable,
                                                                digests=self.verify))
        if self.on_marked is not None and is_main():
            self.on_marked(directory)

    def close(self) -> None:
        """Finish the save in flight (marker included), release the staging buffers and the writer thread."""
        self.wait()
        for stager in self._stagers.values():
            stager.close()
        self._stagers.clear()
        if self.pipeline is not None:
            self.pipeline.close()

    def write_frozen_sources(self) -> None:
        """Every fully frozen module built in memory is written once (`write_frozen_source`)."""
        for name in self.model.module_names:
            if name not in self.trainable:
                write_frozen_source(self.model, name, self.output_dir, self.group)

    # -- load -------------------------------------------------------------------------------------
    def check(self, directory: str, weights_only: bool = False) -> dict:
        """Every check of a checkpoint against this model, before anything is loaded (names the module and
        parameter that differ). `weights_only`: a `save_only_model` checkpoint serves too."""
        marker = files.check_complete(directory, verify=self.verify and is_main())  # agreed on by every rank
        if marker.get("resumable") is False and not weights_only:
            raise ValueError(f"checkpoint {directory} was saved with save_only_model: module weights only, no "
                             "optimizer state; it cannot be resumed (load it with from_pretrained)")
        saved, ours = set(marker["modules"]), set(self.trainable)
        if saved != ours:
            raise ValueError(f"checkpoint {directory} holds trainable modules {sorted(saved)}, this model trains "
                             f"{sorted(ours)} (missing: {sorted(ours - saved)}, extra: {sorted(saved - ours)})")
        config = OmniConfig.from_pretrained(directory)
        if config.module_names != self.model.module_names:
            raise ValueError(f"checkpoint {directory} has modules {config.module_names}, the model "
                             f"{self.model.module_names}")
        return marker

    def load(self, directory: str, optimizer, scheduler, weights_loaded: set[str] = frozenset(),
             weights_only: bool = False) -> None:
        """Every rank: each module's weights (its own rows of a sharded one; frozen modules from their recorded
        source), then — unless `weights_only` (Trainer's best model at the end) — optimizer shards (resharded by
        DCP at another world size) and scheduler."""
        with agreed(f"checking checkpoint {directory}", self.group):
            self.check(directory, weights_only)
            config = OmniConfig.from_pretrained(directory)
            folders = {name: module_folder(directory, config, name) for name in self.model.module_names}
            for name in self.trainable:
                if folders[name] != os.path.join(directory, config.module_entry(name)["subfolder"]):
                    raise ValueError(f"checkpoint {directory}: trainable module {name!r} has no folder of its own")
        saved = {}  # optimizer.json / scheduler.json of each module, read before any weights
        for name in [] if weights_only else self.trainable:
            with agreed(f"module {name!r}: reading {os.path.join(folders[name], module_state.STATE)}", self.group):
                saved[name] = module_state.read_state_json(folders[name])
        todo = {name: folder for name, folder in folders.items()
                if name not in weights_loaded and not is_released(getattr(self.model, name))}  # offline: never read
        for dry_run in (True, False):  # shapes / dtypes of every module first: nothing half-loaded
            for name, folder in todo.items():
                with agreed(f"module {name!r}: reading {folder}", self.group):
                    self._read_weights(name, folder, dry_run)
        for name in self.model.module_names:
            entry = self.model.config.module_entry(name)
            entry["source"] = entry.get("source") or config.module_entry(name).get("source")
        for name in self.trainable:
            if weights_only and os.path.isdir(os.path.join(folders[name], module_state.STATE)):  # (save_only_model:
                module_state.load_module_tensors(folders[name], self._unmapped_tensors(name))  # none, read above)
            elif not weights_only:
                module_state.load_module_state(getattr(self.model, name), optimizer.optimizers[name],
                                               scheduler.schedulers[name], folders[name], self._unmapped_tensors(name),
                                               saved[name])
        if not weights_only:
            files.load_scaler(optimizer.scaler, directory)

    def _read_weights(self, name: str, folder: str, dry_run: bool) -> None:
        """A trainable module from its checkpoint folder (what the HF files cannot serve comes from `state/`); a
        frozen one from its source (through transformers' loading for what the files do not hold as is). A tensor
        that cannot be restored is an error naming the module and tensor."""
        module, unmapped = getattr(self.model, name), self.unmapped(name)
        if name in self.trainable and os.path.isdir(os.path.join(folder, module_state.STATE)):  # (else: a frozen one's)
            read_into(module, folder, strict=True, module_name=name, dry_run=dry_run, skip=unmapped)
            kept = set(module_state.state_keys(folder)) if dry_run and unmapped else set()
            lost = [n for n in sorted(unmapped) if dry_run and f"tensors.{n}" not in kept]
            if lost:
                raise ValueError(f"module {name!r}: {folder}/{module_state.STATE} lacks {len(lost)} tensors {lost[:5]}")
            return
        missing = read_into(module, folder, module_name=name, dry_run=dry_run)
        lost = [n for n in missing if n not in unmapped]
        if lost:
            raise ValueError(f"module {name!r}: {folder} cannot restore {len(lost)} tensors {lost[:5]}")
        if missing and not dry_run:
            lost = read_through_transformers(module, folder, missing, name)
            if lost:
                raise ValueError(f"module {name!r}: {folder} cannot restore {len(lost)} tensors {lost[:5]}")
