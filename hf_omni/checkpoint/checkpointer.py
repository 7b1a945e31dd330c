"""`ModuleCheckpointer`: saves the per-module state of a prepared composed model (`resume.py` reads it back).

A checkpoint is every stateful thing by name: each trainable module's weights (its HF folder) and `state/`, the
per-module optimizers and schedulers (`ModuleOptimizers` / `ModuleSchedulers`, Stateful by module name), the
GradScaler, and the root config; then, last, the marker.

    save:  remove a stale marker -> frozen sources and LoRA bases (once per run) -> per trainable module: HF folder
           (every rank its own rows, in place; a LoRA module with its base written once: the adapter alone)
           + optimizer shards (DCP, every rank) + optimizer / scheduler JSON -> what the model's composition keeps
           beside them (`files.composition`) -> root config.json ->
           [async: later] every rank done -> marker (rank 0, atomic)

The layout is in `files`. RNG and data position stay the loop's (OmniTrainer writes every rank's RNG state through
`rng.py`; a custom loop uses `accelerator.save_state`)."""

from __future__ import annotations

import atexit
import concurrent.futures
import os
import shutil

from ..core.dist import agreed, broadcast_from_main, checkpoint_group, is_main
from ..core.progress import each
from ..files import folder_write
from ..files.composition import composition_of
from ..files.folder import write_frozen_source
from . import contents, marker, module_state, resume
from .async_save import AsyncSave
from .bases import Base, write_base
from .digests import hash_checkpoint
from .state_json import split


class ModuleCheckpointer:
    """Per-module checkpoints of `model`: its trainable modules write a folder each; frozen ones are recorded by
    source (a module built in memory is written once to `<output_dir>/frozen/<module>/`)."""

    def __init__(self, model, output_dir: str | None, save_async: bool, verify: bool = False,
                 show_progress: bool = True, timeout_s: float | None = None):
        self.model, self.show_progress = model, show_progress
        self.output_dir, self.save_async, self.verify = output_dir, save_async, verify
        for slot in model.slots.values():
            slot.checkpoint = module_state.ModuleState(slot)
        self._pending: tuple | None = None  # (directory, step, futures, resumable) of a save without its marker
        self.async_save = AsyncSave() if save_async else None  # async saves: staging thread + writer process
        self._exit_hook = False
        self.group = checkpoint_group(timeout_s)  # every step one rank does alone ends in an agreement on it
        self.async_group = checkpoint_group(timeout_s, "writer") if save_async else None  # the staging thread's
        self.on_marked = None  # called with a checkpoint's folder on rank 0 once its marker is written (Hub push)
        self.bases: dict[str, Base] = {}  # LoRA bases this run's checkpoints refer to (written once, or resumed)

    @property
    def trainable(self) -> list[str]:
        return [name for name, slot in self.model.slots.items() if slot.trains]

    @property
    def states(self) -> dict[str, module_state.ModuleState]:
        """Each module's checkpoint state (kept in its slot)."""
        return {name: slot.checkpoint for name, slot in self.model.slots.items()}

    def base_folders(self) -> tuple[str, ...]:
        """The LoRA bases this run's checkpoints refer to (rotation keeps them)."""
        return tuple(base.folder for base in self.bases.values())

    def folder(self, directory: str, name: str) -> str:
        return os.path.join(directory, self.model.slots[name].entry.subfolder)

    # -- save -------------------------------------------------------------------------------------
    def save(self, directory: str, optimizer, scheduler, step: int | None = None, write_marker: bool = True,
             weights_only: bool = False) -> None:
        """Every rank: module folders, optimizer shards and schedulers, the root `config.json`; the marker after
        every rank finished every file (with `save_async`, at the next save or `wait()`). `weights_only`
        (Trainer's `save_only_model`): module folders without `state/`, marked not resumable."""
        self.wait()
        with agreed(f"saving {directory}", self.group):  # a problem found inside the window just stepped: no save
            problem = self.model.deferred_problem()
            if problem is not None:
                raise ValueError(problem)
        with agreed(f"preparing {directory}", self.group):
            if is_main():
                self._clear(directory)
        for slot in self.model.slots.values():
            if not slot.trains:
                write_frozen_source(slot, self.output_dir, self.group)
            elif self.output_dir and slot.name not in self.bases and self.states[slot.name].fixed_base:
                self.bases[slot.name] = write_base(slot, self.states[slot.name].base_plan(), self.output_dir,
                                                   self.group, self.verify)
        used = {name: base for name, base in self.bases.items()  # a base that trains is written with the module
                if name in self.trainable and self.states[name].fixed_base}
        async_save = self.async_save
        if async_save is not None:
            async_save.begin([self.model.slots[name].module for name in self.trainable])
        optimizer_states = {} if weights_only else optimizer.state_dict()  # every rank its own shards
        scheduler_states = {} if weights_only else scheduler.state_dict()
        for name in each(self.trainable, f"saving {directory}", enabled=self.show_progress and async_save is None):
            slot, folder, base = self.model.slots[name], self.folder(directory, name), used.get(name)
            plan = self.states[name].plan.adapter_only() if base is not None else self.states[name].plan
            with agreed(f"module {name!r}: writing {folder}", self.group):  # every rank its own rows
                folder_write.write_module_folder(slot.module, folder, plan, slot.processor, dtypes=slot.export_dtypes,
                                                 async_save=async_save, base=base.folder if base is not None else None)
            if weights_only:
                continue
            tensors, rest = split(optimizer_states[name], os.path.join(folder, module_state.STATE))
            with agreed(f"module {name!r}: writing {os.path.join(folder, module_state.STATE)} "
                        f"({module_state.OPTIMIZER}, {module_state.SCHEDULER})", self.group):
                if is_main():
                    module_state.save_json(rest, folder, module_state.OPTIMIZER)
                    module_state.save_scheduler(scheduler_states[name], folder)
                    if slot.ema is not None:  # its shadows go with the optimizer shards
                        module_state.save_json(slot.ema.state_json(), folder, module_state.EMA_JSON)
            self.states[name].save_tensors(folder, tensors, async_save=async_save, group=self.async_group)
        composition = composition_of(self.model.config)
        composition.save_checkpoint(self.model, directory)  # every rank (an adopted model: its released format)
        with agreed(f"writing {os.path.join(directory, 'config.json')}", self.group):
            if is_main():
                composition.write_root(self.model, directory)
                if not weights_only:
                    contents.save_scaler(optimizer.scaler, directory)
        futures = async_save.start(self.async_group) if async_save is not None else []
        self._pending = (directory, step, futures, not weights_only, {n: b.record() for n, b in used.items()})
        if futures and not self._exit_hook:  # process exit waits for shards still being written
            atexit.register(lambda: [f.result() for f in (self._pending or (None, None, [], None, None))[2]])
            self._exit_hook = True
        if write_marker and not self.save_async:
            self.wait()

    def _clear(self, directory: str) -> None:
        """Rank 0, before a save into `directory`: no marker (incomplete until the new one), no old shards or weight
        files of the trainable modules (files are written in place, untruncated; old shards would be read back)."""
        os.makedirs(directory, exist_ok=True)
        stale = os.path.join(directory, marker.MARKER)
        if os.path.exists(stale):
            os.remove(stale)
            marker.fsync_dir(directory)
        for name in self.trainable:
            old = os.path.join(self.folder(directory, name), module_state.STATE)
            if os.path.isdir(old):
                shutil.rmtree(old)
            folder_write.remove_weight_files(self.folder(directory, name))
            os.makedirs(self.folder(directory, name), exist_ok=True)

    def fence(self) -> None:
        """Before an optimizer step: the async save in flight has copied what it writes."""
        if self.async_save is not None:
            self.async_save.fence()

    def wait(self) -> None:
        """Finish the save in flight: wait for its files on every rank, then write its marker (rank 0)."""
        if self._pending is None:
            return
        directory, step, futures, resumable, bases = self._pending
        self._pending = None
        concurrent.futures.wait(futures)  # every job done (a failed one does not stop the later ones)
        with agreed(f"writing checkpoint {directory}", self.group):
            for future in futures:
                future.result()
        sizes = digests = None
        if self.verify:  # every rank hashes its share of the files, outside the agreement on the marker
            sizes = broadcast_from_main(marker.file_sizes(directory) if is_main() else None, self.group)
            with agreed(f"hashing {directory}", self.group):
                digests = hash_checkpoint(directory, sizes, self.group)
        with agreed(f"writing {os.path.join(directory, marker.MARKER)}", self.group):
            if is_main():
                marker.write_marker(directory, contents.marker_info(directory, step, self.trainable, resumable, sizes,
                                                                digests, bases))
        if self.on_marked is not None and is_main():
            self.on_marked(directory)

    def close(self) -> None:
        """Finish the save in flight (marker included), release the staging buffers, the thread and the writer process."""
        self.wait()
        if self.async_save is not None:
            self.async_save.close()

    # -- load (resume.py) ---------------------------------------------------------------------------
    def load(self, directory: str, optimizer, scheduler, weights_loaded: set[str] = frozenset(),
             weights_only: bool = False) -> None:
        """Every rank: each module's weights (its own rows of a sharded one; frozen modules from their recorded
        source), then — unless `weights_only` (Trainer's best model at the end) — optimizer shards (resharded by
        DCP at another world size) and schedulers."""
        resume.load(self, directory, optimizer, scheduler, weights_loaded, weights_only)
