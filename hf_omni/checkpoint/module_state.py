"""One module's resume state, `<module>/state/`, none of it pickled:

    shard-<rank>-<i>-of-<n>.safetensors   optimizer tensors and the module tensors its HF files cannot serve as is
                                          (fp32 masters of a module exported in bf16, ...), through DCP
                                          (`shard_writer`): every rank its own shards, offsets in the header
    optimizer.json                        param groups, non-tensor per-parameter values and one-element tensors
                                          (AdamW's step) as numbers (rank 0; `state_json`)
    scheduler.json                        the scheduler's `state_dict()` (rank 0)
    ema.json                              `ema`: the EMA's step counter and settings (rank 0); its shadows are
                                          `ema.<param>` tensors of the shards (`modules.ema`)

Why: DCP's default layout keeps its metadata in a pickle (`.metadata`), so resuming a downloaded checkpoint could
run code. Here what a load reads is safetensors headers and JSON: DCP's `HuggingFaceStorageReader` rebuilds the
metadata from the headers and still reshards at another world size.
"""

from __future__ import annotations

import functools
import json
import logging
import os

import torch
import torch.distributed as dist

from ..core.dist import checkpoint_group
from ..files.folder_plan import plan_folder
from ..files.folder_write import tensor_mesh
from ..files.lora_base import has_fixed_base
from ..files.saved_keys import file_layout, module_tensors
from ..modules.ema import EMA_JSON
from ..shards.replicas import load_once
from .shard_plan import shard_files
from .shard_reader import ShardReader
from .shard_writer import ShardWriter
from .state_json import json_value, like

STATE = "state"
OPTIMIZER = "optimizer.json"
SCHEDULER = "scheduler.json"
logger = logging.getLogger("hf_omni")


WRITER_THREADS = 2  # files (and threads) per rank and module: bench/checkpoint.py measured 1, 2 and 4


def _writer(state_dir: str):
    return ShardWriter(state_dir, threads=WRITER_THREADS)


def _reader(state_dir: str, group=None, alone: bool = False, metadata=None):
    """DCP's reader of `state/` (`shard_reader`); `metadata`: what `state_metadata` returned for it, reused."""
    return ShardReader(state_dir, group, alone, metadata)


def save_json(value, folder: str, name: str) -> None:
    """`state/<name>` (rank 0): `optimizer.json` (the JSON half of `optimizer_state`) or any small state."""
    os.makedirs(os.path.join(folder, STATE), exist_ok=True)
    with open(os.path.join(folder, STATE, name), "w") as f:
        json.dump(value, f)


def save_state_tensors(folder: str, optimizer_tensors: dict, tensors: dict, async_save=None, group=None,
                       ema: dict | None = None, mesh=None) -> None:
    """The tensors of `state/` through DCP (every rank its own shards; DCP raises on every rank when one fails).
    Async (`async_save`, an `async_save.AsyncSave`): it copies them in its thread before the next optimizer
    step, into its staging buffers, reused from one save to the next (a master weight copied once, for `state/`
    and the HF files alike); this rank's files are then planned on it alone (`shard_plan`; `group`: the ranks,
    `mesh`: a tensor-parallel module's whole mesh) and written by the writer process, with no collective.
    `ema`: the EMA shadows, beside them."""
    import torch.distributed.checkpoint as dcp

    state_dir = os.path.join(folder, STATE)
    os.makedirs(state_dir, exist_ok=True)
    state = {"optimizer": {"state": optimizer_tensors}, "tensors": tensors, **({"ema": ema} if ema else {})}
    if async_save is None:
        dcp.save(state, storage_writer=_writer(state_dir))
        return
    staged = async_save.stage(state, prefix=f"{os.path.basename(folder)}/{STATE}/")
    rank, world = (dist.get_rank(group), dist.get_world_size(group)) if group is not None else (0, 1)

    def hand_off():  # planned here on this rank alone (`shard_plan`), written by the writer process
        files = [(name, head, [async_save.staging.ref(t) for t in tensors])
                 for name, head, tensors in shard_files(staged(), rank, world, WRITER_THREADS, mesh)]
        async_save.hand_off("shards", (state_dir, files))

    async_save.then(hand_off, f"writing {state_dir}")


def save_scheduler(state: dict, folder: str) -> None:
    """The module's scheduler state in `state/` as JSON (rank 0)."""
    save_json(json_value(state, f"{folder}: scheduler"), folder, SCHEDULER)


def state_metadata(folder: str):
    """DCP's metadata of `state/` (its headers: rank 0 reads, all receive); a resume reads it once a module."""
    return _reader(os.path.join(folder, STATE), checkpoint_group()).read_metadata()


def state_keys(folder: str, metadata=None) -> list[str]:
    """The sorted keys of a module's `state/` (DCP's: `optimizer.state.<param>.<name>`, `tensors.<name>`, ...)."""
    return sorted((metadata if metadata is not None else state_metadata(folder)).state_dict_metadata)


def load_module_tensors(folder: str, tensors: dict, extra: dict | None = None, metadata=None) -> None:
    """Only the module `tensors` of a `state/` (no optimizer), and `extra` (`{"ema": ...}`): DCP reads just the keys
    asked for."""
    state = {**({"tensors": tensors} if tensors else {}), **(extra or {})}
    if state:
        load_once(state, functools.partial(_reader, os.path.join(folder, STATE), metadata=metadata),
                  f"reading {folder}")


def read_state_json(folder: str) -> tuple[dict, dict]:
    """(`optimizer.json`, `scheduler.json`) of a module's `state/`, read on every rank before any collective: a rank
    that cannot read them fails alone, and the checkpointer's agreement tells every rank."""
    state_dir = os.path.join(folder, STATE)
    out = []
    for name, kind in ((OPTIMIZER, {"state": dict, "param_groups": list}), (SCHEDULER, {})):
        path = os.path.join(state_dir, name)
        try:
            with open(path) as f:
                value = json.load(f)
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise ValueError(f"{path} is not valid JSON ({err})") from None
        if not isinstance(value, dict) or any(not isinstance(value.get(k), t) for k, t in kind.items()):
            raise ValueError(f"{path} is not an hf_omni {name}")
        out.append(value)
    return out[0], out[1]


def read_ema_json(folder: str) -> dict | None:
    """`state/ema.json`, or None for a checkpoint saved without EMA (every rank, before any collective)."""
    path = os.path.join(folder, STATE, EMA_JSON)
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        value = json.load(f)
    if not isinstance(value, dict) or not isinstance(value.get("optimization_step"), int):
        raise ValueError(f"{path} is not an hf_omni {EMA_JSON}")
    return value


def restore_ema(name: str, ema, folder: str, saved: dict | None, metadata=None) -> None:
    """A module's EMA from its `state/` (shadows filled in place, resharded by DCP at another world size). A
    checkpoint without EMA: the shadows start from the weights just loaded, counter 0 (a fresh `EMAModel`); a
    checkpoint's EMA that this run does not keep is left unread."""
    if ema is None:
        if saved is not None:
            logger.info("hf_omni: module %r: %s holds EMA weights; this run keeps none (not read)", name, folder)
        return
    if saved is None:
        logger.warning("hf_omni: module %r: %s has no EMA state: its EMA starts from the resumed weights", name, folder)
        ema.reset()
        return
    state_dir = os.path.join(folder, STATE)
    load_once({"ema": dict(ema.shadows)}, functools.partial(_reader, state_dir, metadata=metadata),
              f"reading {state_dir} (EMA)")
    ema.load_json(saved)


def read_optimizer_state(folder: str, template: dict, saved: dict, tensors: dict, metadata=None) -> dict:
    """One module's optimizer state from its `state/`: `template` is the live optimizer's (`ModuleOptimizers.
    state_dict()[module]`, its tensors shaped as this rank holds them), filled in place from the shards (resharded
    by DCP at another world size) and `saved` (`optimizer.json`); parameters with no saved state (never stepped)
    are left out. The module `tensors` the HF files cannot serve are read in place in the same pass."""
    state_dir = os.path.join(folder, STATE)
    live_groups = template["param_groups"]
    if [g.get("params") for g in saved["param_groups"]] != [g["params"] for g in live_groups]:
        raise ValueError(f"{state_dir}/{OPTIMIZER}: its param groups hold other parameters than this module's "
                         "optimizer (another model, or another weight-decay split)")
    for fqn in [fqn for fqn in template["state"] if fqn not in saved["state"]]:
        del template["state"][fqn]
    optim_tensors = {fqn: {k: v for k, v in values.items() if isinstance(v, torch.Tensor) and k not in
                           saved["state"][fqn]} for fqn, values in template["state"].items()}  # (older saves: step)
    loaded = {"optimizer": {"state": optim_tensors}, "tensors": tensors}
    load_once(loaded, functools.partial(_reader, state_dir, metadata=metadata), f"reading {state_dir}")
    for fqn, values in template["state"].items():
        values.update(loaded["optimizer"]["state"][fqn])
        values.update({k: like(v, values.get(k)) for k, v in saved["state"][fqn].items()})
    for live, saved_group in zip(live_groups, saved["param_groups"]):
        live.update({k: like(v, live.get(k)) for k, v in saved_group.items() if k != "params"})
    return template


class ModuleState:
    """One trainable module's `state/` as the checkpointer keeps it between saves: which of its tensors the HF
    files cannot serve (`unmapped`: not in them as is, worked out once; `masters`: master weights the files hold
    rounded to the dtype they were loaded in)."""

    def __init__(self, slot):
        self.slot = slot
        self._unmapped: frozenset[str] | None = None
        self._plan = None
        self._fixed_base: bool | None = None

    @property
    def plan(self):
        """Its HF files' plan (`files.folder_plan`), worked out at the first save."""
        if self._plan is None:
            self._plan = plan_folder(self.slot.module, self.slot.export_dtypes)
        return self._plan

    @property
    def fixed_base(self) -> bool:
        """A LoRA module whose base never changes (`lora.base.has_fixed_base`): its base is written once."""
        if self._fixed_base is None:
            self._fixed_base = has_fixed_base(self.slot.module)
        return self._fixed_base

    def base_plan(self):
        """The plan of its base's files alone (no adapter), as a plain model of its class holds them."""
        return plan_folder(self.slot.module, self.slot.export_dtypes, merged=True)

    @property
    def unmapped(self) -> frozenset[str]:
        if self._unmapped is None:
            layout = file_layout(self.slot.module)
            self._unmapped = frozenset(n for n in module_tensors(self.slot.module) if n not in layout)
        return self._unmapped

    @property
    def masters(self) -> frozenset[str]:
        precision = self.slot.precision
        return frozenset(precision.masters) if precision is not None else frozenset()

    def unmapped_tensors(self, masters: frozenset[str] | None = None) -> dict:
        """The tensors `state/` holds: the unmapped ones and the master weights (`masters`: those of them a
        checkpoint being read holds; a checkpoint of a run without masters serves them from its HF files)."""
        tensors = module_tensors(self.slot.module)
        names = self.unmapped | (self.masters if masters is None else masters)
        return {n: tensors[n].detach() for n in sorted(names)}

    def save_tensors(self, folder: str, optimizer_tensors: dict, async_save=None, group=None) -> None:
        """The optimizer's tensors and the unmapped ones, every rank its own shards (`save_state_tensors`)."""
        ema = self.slot.ema
        if ema is not None and ema.swapped:
            raise RuntimeError(f"module {self.slot.name!r}: a checkpoint inside ema_weights() would save the EMA "
                               "weights as the live ones")
        save_state_tensors(folder, optimizer_tensors, self.unmapped_tensors(), async_save=async_save,
                           group=group, ema=dict(ema.shadows) if ema is not None else None,
                           mesh=tensor_mesh(self.slot.module) if async_save is not None else None)
