"""Every rank writes its own part of a module's HF folder, in place (`folder_plan` gives every key's byte offset).

Who writes which bytes of a tensor written as is:
- sharded on dim 0 (FSDP2): the ranks holding a shard write its rows; under HSDP the R replicas of a shard each
  write 1/R of its rows; sharded on another dim (`Shard(d)`, d > 0): the files are row-major, so it is first
  redistributed to dim-0 shards (`shards.box.as_rows`: one all-to-all per such tensor, every rank of its mesh in
  plan order, each sending and receiving about its shard's bytes), then written as one sharded on dim 0;
- tensor parallel (`tensor_mesh`): a column slice `(_StridedShard(0), Shard(0))` is one box of rows, written as
  such; a row slice `(Shard(0), Shard(1))` is gathered over `tp` to its dim-0 shard's full rows (`as_rows`: each rank
  receives (T-1)/T of 1/S of the tensor), which its T tp ranks split as replicas; a tensor on fewer mesh dims than
  the module (a norm on `(dp_shard,)`) is a replica over the others: its rows are split over the tp group;
- held whole by every rank (DDP, frozen, no process group): its rows are split over the ranks, a small one
  (under 1 MiB, or fewer rows than ranks) goes whole to one rank, round robin; a buffer goes whole to rank 0
  (running statistics may differ between ranks: a checkpoint holds rank 0's).
A derived group (MoE experts split on save) is converted by one rank from its source tensors gathered there
(`folder_derived`: `dist.gather` of the shards on the dim they are sharded on, so fused experts on `Shard(1)` gather
no padding). Every collective here (gathers, redistributions, LoRA's whole `lora_A`) runs on the device the
tensors' group serves (`shards.device.on_group_device`: an offloaded module's CPU shards go to the accelerator and
back). A rank-local step between two collectives that fails (a merge, a cast, a conversion, an OSError) does not
stop this rank from joining the collectives that follow: its error is raised once every rank has joined them all,
into the agreement after the write. Rank 0
writes the headers, the index, config.json (the dtype the module exports in), the generation config, the processor
and the adapter config. Each rank holds at most one 64 MB piece of a tensor converted to the export dtype at a
time (a derived group: its tensors; a tensor sharded off dim 0: also its dim-0 shard, one tensor at a time when
saving synchronously, all of them until staged under an async save); nothing funnels the module through one rank.
Files are opened without truncation: the caller removes stale weight files before any rank writes
(`remove_weight_files`), and agrees on success after.
"""

from __future__ import annotations

import os
from typing import Any

from torch import nn

from ..core.dist import has_process_group, is_main
from ..lora.merge import full, merged_rows
from ..shards.box import as_rows, local_of, local_rows, sharded_off_rows
from .folder_derived import derived_tensors, rank_world, replica, sharded
from .folder_metadata import export_dtype, write_metadata
from .folder_plan import FolderPlan
from .format import index_names
from .in_place import Files, write_tensor
from .saved_keys import module_tensors

SMALL = 2**20  # tensors below this (or with fewer rows than ranks) are written whole by one rank


def remove_weight_files(folder: str) -> None:
    """Stale safetensors files and index of an earlier save into `folder` (rank 0, before any rank writes)."""
    if os.path.isdir(folder):
        for name in os.listdir(folder):
            if name.endswith(".safetensors") or name in index_names():
                os.remove(os.path.join(folder, name))


def _chunk(start: int, stop: int, index: int, count: int) -> tuple[int, int]:
    size = -(-(stop - start) // count) if stop > start else 0
    lo = min(start + index * size, stop)
    return lo, min(lo + size, stop)


def has_shards(module: nn.Module) -> bool:
    """Whether any of `module`'s tensors is sharded (then every rank takes part in writing it)."""
    return any(sharded(t) for t in module_tensors(module).values())


def my_rows(tensor, number: int, nbytes: int, solo: bool = False, buffer: bool = False, full=None
            ) -> tuple[int, int, Any, int] | None:
    """The rows [lo, hi) of `tensor` (its `number`-th entry in the plan) this rank writes, with the local tensor
    they are read from and the global row of its row 0; None: nothing. `solo`: this process writes everything.
    A `buffer` not sharded is rank 0's (BatchNorm statistics may differ between ranks: a checkpoint holds rank 0's).
    A tensor sharded off dim 0 is redistributed to dim-0 shards first (`as_rows`: every rank of its mesh calls this
    for it, in plan order). `full`: a tensor-parallel module's whole mesh (`tensor_mesh`)."""
    rank, world = rank_world(solo)
    rows = tensor.shape[0] if tensor.ndim else 1
    if sharded(tensor):
        tensor = as_rows(tensor)
        start, stop = local_rows(tensor)
        lo, hi = _chunk(start, stop, *replica(tensor, full))
        return (lo, hi, tensor.to_local(), start) if hi > lo else None
    local = local_of(tensor)
    if buffer:
        return (0, rows, local, 0) if rank == 0 else None
    if world == 1 or tensor.ndim == 0 or rows < world or nbytes < SMALL:
        return (0, rows, local, 0) if number % world == rank else None
    lo, hi = _chunk(0, rows, rank, world)
    return (lo, hi, local, 0) if hi > lo else None


def _jobs(module: nn.Module, plan: FolderPlan, tensors: dict, dtypes: dict, solo: bool, merge: dict | None,
          buffers: set, files, failed: list, whole_mesh=None) -> list:
    """Every rank, in plan order (its collectives with it): (file, offset, values, dtype) of this rank's share of
    each tensor written as is (a LoRA layer's rows merged), then of the derived groups it converts. A share of a
    tensor redistributed off dim 0 is written to `files` at once (a save that is not async) and let go; an OSError
    there, and any error of a rank-local step (a merge, a derived group's conversion), goes to `failed`, raised once
    every rank has joined every collective."""
    lora_a = {n: full(tensors[n]) for spec in (merge or {}).values() for n in spec.wholes}  # every rank, in order
    jobs = []  # (file, offset, local tensor rows, dtype)
    for number, entry in enumerate(plan.entries):
        if entry.source is None:
            continue
        source = tensors[entry.source]
        spec = merge.get(entry.source) if merge else None
        rowed = {n: as_rows(tensors[n]) for n in (spec.b, spec.magnitude, spec.copy) if n} if spec else {}
        share = my_rows(source, number, entry.nbytes, solo, entry.source in buffers, whole_mesh)  # every rank, in plan order
        if share is None:
            continue
        lo, hi, local, first = share
        row_bytes = entry.nbytes // max(source.shape[0] if entry.shape else 1, 1)
        values = local[lo - first:hi - first] if local.ndim else local
        if spec is not None and not failed:
            try:
                values = merged_rows(values, lo, hi, spec, {**tensors, **rowed}, lora_a)
            except Exception as err:
                if solo or not has_process_group():  # no other rank waits
                    raise
                failed.append(err)
        if failed:
            continue
        job = (entry.file, entry.offset + lo * row_bytes, values, entry.dtype)
        if not values.numel():
            continue
        if files is None or not any(sharded_off_rows(tensors[n]) for n in [entry.source, *rowed]):
            jobs.append(job)
        elif not failed:  # a share of a redistributed tensor: written now and let go (one extra shard at a time)
            try:
                write_tensor(files, *job)
            except OSError as err:  # raised once every rank has joined every collective below
                failed.append(err)
    for index in sorted({e.group for e in plan.entries if e.group is not None}):  # the same on every rank
        derived = derived_tensors(module, plan, index, dtypes, solo, failed)
        for entry in (e for e in plan.entries if e.group == index and derived is not None):
            jobs.append((entry.file, entry.offset, derived[entry.key], entry.dtype))
    return jobs


def tensor_mesh(module: nn.Module):
    """The module's whole mesh: the largest of its tensors' meshes (a tensor-parallel module's `(dp_shard, tp)`), or
    None for a module with no DTensor. Its tensors on fewer of that mesh's dims are replicas over the rest
    (`replica`); tensors on meshes that are not part of it keep their own."""
    meshes = [t.device_mesh for t in module_tensors(module).values() if hasattr(t, "device_mesh")]
    return max(meshes, key=lambda m: m.ndim, default=None)


def write_module_folder(module: nn.Module, folder: str, plan: FolderPlan, processor=None,
                        dtypes: dict | None = None, async_save=None, solo: bool = False, merge: dict | None = None,
                        base: str | None = None, main_only: frozenset = frozenset()) -> None:
    """Every rank: its part of `module`'s HF files at their offsets in `folder` (rank 0 also the headers and small
    files). `dtypes`: the dtype each tensor is exported in, by name (master weights' loaded dtypes). With a
    `async_save` (async saves) the rows are copied before the next optimizer step and written in its thread; derived
    groups are gathered and converted now (on the device), copied to the host in its thread too. `solo`: the calling process writes every file alone (a module with no
    sharded tensor, saved by one rank). `merge` (`lora.merge.row_merge_plan`, with a `merged` plan): each LoRA
    layer's weight rows written merged. `base`: the adapter config's base reference (an adapter-only plan whose base
    is written apart, `lora_base`). `main_only`: tensors the main process writes alone (only it holds them: an
    adopted model's offline module, read back from its source for the write)."""
    dtypes = dtypes or {}
    dtype = export_dtype(module, dtypes)
    tensors = module_tensors(module)
    buffers = {name for name, _ in module.named_buffers()} | set(main_only)  # rank 0's
    files, failed = Files(folder) if async_save is None else None, []  # saved now: a redistributed share at once
    try:  # fds of shares written already are closed whatever fails
        jobs = _jobs(module, plan, tensors, dtypes, solo, merge, buffers, files, failed,
                     tensor_mesh(module))
    except BaseException:
        if files is not None:
            files.close()
        raise
    if failed and async_save is not None:  # every collective joined: raised into the agreement after the write
        raise failed[0]
    main = solo or is_main()

    def write(values, files):
        os.makedirs(folder, exist_ok=True)
        try:
            if failed:
                raise failed[0]
            if main:
                for name, head in plan.files.items():
                    files.write(name, 0, head)
                write_metadata(module, folder, plan, processor, dtype, base)
            for (name, offset, _, target), tensor in zip(jobs, values):
                write_tensor(files, name, offset, tensor, target)
        finally:
            files.close()

    if async_save is None:
        return write([values for _, _, values, _ in jobs], files)
    staged = async_save.snapshot({str(i): values for i, (_, _, values, _) in enumerate(jobs)},
                               prefix=os.path.basename(folder) + "/")

    def hand_off():  # the small files here, the headers and rows by the writer process
        os.makedirs(folder, exist_ok=True)
        if main:
            write_metadata(module, folder, plan, processor, dtype, base)
        heads = [(name, 0, bytes(head)) for name, head in plan.files.items()] if main else []
        rows = [(name, offset, async_save.staging.ref(staged()[str(i)]), str(target))
                for i, (name, offset, _, target) in enumerate(jobs)]
        async_save.hand_off("folder", (folder, heads, rows))

    async_save.then(hand_off, f"writing {folder}")
