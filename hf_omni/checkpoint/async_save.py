"""`AsyncSave`: the background thread that stages async saves for their writer process, and what it may copy late.

An async save hands every tensor it will write to this thread, which first copies them all (staging), then hands
them, module after module, in the same order on every rank, to the rank's writer process (`writer_process`), which
writes the files while the thread waits (its agreements on the checkpoint's own gloo group). The loop goes on meanwhile: parameters and optimizer state change only in the optimizer step, so the step
waits for the copies (`fence()`, which `ModuleOptimizers.step` calls) and the copies overlap the next forward and
backward instead of stalling the loop. Buffers can change in a forward (BatchNorm statistics, DDP's broadcast of
them): they are copied at once. Tensors that belong to no module (a MoE group converted for the save, a sharded
module's rows gathered off dim 0) are private: copied late too, so no device-to-host copy runs on the training
thread. The late copies go into reused (pinned) buffers on a copy stream of their own (`staging`), ordered by events
(no device-wide synchronize); a master weight that `state/` keeps in fp32 and the HF files export rounded is copied
once, the export cast from the staged copy at write time.
"""

from __future__ import annotations

import concurrent.futures
from typing import Callable

import torch
from torch import nn

from ..compat import dtensor_over
from ..core.dist import agreed
from ..shards.box import local_of
from .staging import CopyStream, Staging
from .writer_process import WriterError, WriterProcess


def storage_of(tensor: torch.Tensor) -> int:
    return local_of(tensor).untyped_storage().data_ptr()


def copy_to_cpu(tensor: torch.Tensor, into: torch.Tensor | None = None, non_blocking: bool = False) -> torch.Tensor:
    """`tensor` on the host: into `into` (a reused staging buffer; `non_blocking` on the copy stream, which is
    synchronised before any write) when given, else a fresh copy."""
    local = local_of(tensor.detach())
    if into is None:
        return local.to("cpu", copy=True).contiguous()
    into.copy_(local, non_blocking=non_blocking and into.is_pinned())
    return into


class BackgroundWriteError(RuntimeError):
    """A write of an async save failed in the background thread: names the module and folder."""


def named(what: str, write: Callable[[], None], copied: concurrent.futures.Future) -> Callable[[], None]:
    def job():
        if copied.exception() is not None:
            raise BackgroundWriteError(f"{what}: skipped, the copies of this save failed")
        try:
            write()
        except BaseException as err:  # DCP's CheckpointException is a BaseException
            kind = "" if isinstance(err, WriterError) else f"{type(err).__name__}: "  # the writer's text names it
            raise BackgroundWriteError(f"{what}: {kind}{err}") from err

    return job


class Late(str):
    """Where a tensor staged later goes in a DCP state's layout (its key path)."""


def fill(layout, held: dict):
    if isinstance(layout, dict):
        return {key: fill(item, held) for key, item in layout.items()}
    return held[layout] if isinstance(layout, Late) else layout


def rewrap(tensor: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """The staged `local` in `tensor`'s form: a DTensor of the same mesh, placements and global shape (what DCP
    plans the write from), or the plain host tensor."""
    return dtensor_over(tensor, local) if hasattr(tensor, "to_local") else local


class AsyncSave:
    def __init__(self):
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._copies: list[Callable[[], None]] = []
        self._writes: list[tuple[str, Callable[[], None]]] = []
        self._staged: concurrent.futures.Future | None = None
        self._state_copies: list[Callable[[], None]] = []
        self._params: set[int] = set()
        self._buffers: set[int] = set()
        self._whole: dict[int, tuple] = {}  # storage -> (its parameter's local tensor, its staged copy)
        self.staging, self.stream = Staging(shared=True), CopyStream()
        self.writer: WriterProcess | None = None  # forked at the first save that writes

    def begin(self, modules: list[nn.Module]) -> None:
        """A new save of `modules` (the previous one finished; its optimizer step issued): learn which storages are
        live parameters and buffers."""
        self._copies, self._state_copies, self._writes, self._whole = [], [], [], {}
        self._params = {storage_of(p) for m in modules for p in m.parameters()}
        self._buffers = {storage_of(b) for m in modules for b in m.buffers()}

    def snapshot(self, tensors: dict[str, torch.Tensor], prefix: str = "") -> Callable[[], dict[str, torch.Tensor]]:
        """`tensors` as they are now, on CPU: buffers copied here; every other tensor (parameters, and private ones:
        a MoE group converted for the save, rows gathered off dim 0) in its thread before the next
        optimizer step, into staging buffers named `prefix` + name, reused by the next save. A view of a parameter
        that a DCP state of the same save stages whole (a master weight: fp32 in `state/`, its rows in the HF
        files) is read from that staged copy: copied once. Returns the getter the writes call."""
        out, late = {}, []
        for name, tensor in tensors.items():
            if storage_of(tensor) in self._buffers:
                out[name] = copy_to_cpu(tensor, self.staging.buffer(prefix + name, tensor))
            else:
                late.append(name)

        def copy_late():
            for name in late:
                out[name] = self._staged_view(tensors[name])
                if out[name] is None:
                    out[name] = copy_to_cpu(tensors[name], self.staging.buffer(prefix + name, tensors[name]), True)

        self._copies.append(copy_late)
        return lambda: out

    def _staged_view(self, tensor: torch.Tensor) -> torch.Tensor | None:
        """`tensor` (a contiguous view) read from a staged whole copy of its storage, None when there is none."""
        local = local_of(tensor.detach())
        whole = self._whole.get(storage_of(tensor))
        if whole is None or whole[1] is None or not local.is_contiguous() or local.dtype != whole[0].dtype:
            return None
        source, staged = whole
        at = local.storage_offset() - source.storage_offset()
        if at < 0 or at + local.numel() > source.numel():
            return None
        return staged.reshape(-1)[at:at + local.numel()].view(local.shape)

    def stage(self, state: dict, prefix: str = "") -> Callable[[], dict]:
        """A DCP state (optimizer tensors; module tensors) on CPU, in the same staging buffers (`prefix` + its key
        path) as `snapshot`: buffers copied here, everything else in its thread before the next optimizer
        step, a DTensor as a DTensor of the same placements over its staged local shard. Its parameters are
        staged before any `snapshot` copy of this save, which reads views of them from there."""
        staged: dict = {}
        late: list[tuple[str, torch.Tensor]] = []

        def walk(value, path: str):
            if isinstance(value, dict):
                return {key: walk(item, f"{path}.{key}" if path else str(key)) for key, item in value.items()}
            if not isinstance(value, torch.Tensor):
                return value
            if storage_of(value) in self._buffers:
                return rewrap(value, copy_to_cpu(value, self.staging.buffer(prefix + path, value)))
            late.append((path, value))
            if storage_of(value) in self._params and local_of(value).is_contiguous():
                self._whole[storage_of(value)] = (local_of(value.detach()), None)  # filled by the copy below
            return Late(path)

        layout = walk(state, "")

        def copy_state():
            held = {}
            for path, tensor in late:
                local = copy_to_cpu(tensor, self.staging.buffer(prefix + path, tensor), True)
                held[path] = rewrap(tensor, local)
                if self._whole.get(storage_of(tensor), (None, 0))[1] is None:
                    self._whole[storage_of(tensor)] = (local_of(tensor.detach()), local)
            staged["value"] = fill(layout, held)

        self._state_copies.append(copy_state)
        return lambda: staged["value"]

    def then(self, write: Callable[[], None], what: str) -> None:
        """A write of this save (`what` names it in errors), after every copy, in order."""
        self._writes.append((what, write))

    def start(self, group=None) -> list[concurrent.futures.Future]:
        """Run this save's copies, then its writes (handed to the writer process, forked here at the first save), in
        the background; returns their futures. After the copies every rank agrees (on `group`) that every rank
        copied, so every rank writes, or skips every write, alike; each write is its own job, so one that fails
        (rank 0's HF files) does not keep the later ones (every rank's shards) from running."""
        copies, staged = self._state_copies + self._copies, concurrent.futures.Future()  # whole copies first
        self._staged = staged
        self.stream.mark()  # after everything this save computed on the device (a MoE group's conversion)
        device = torch.cuda.current_device() if torch.cuda.is_available() else None  # threads start on cuda:0

        def copy_all():
            try:
                if device is not None:
                    torch.cuda.set_device(device)  # the copy stream's events are this rank's own GPU's
                with agreed("copying the state of an async save", group):
                    with self.stream.copying():
                        for copy in copies:
                            copy()
                    if self.staging.fresh():  # buffers new in this save: the writer maps them once
                        self.writer.request("map", self.staging.fresh())
                        self.staging.mapped()
            finally:
                staged.set_result(None)

        if self.writer is None and self._writes:
            self.writer = WriterProcess()  # from the main thread (it dies with the thread that forked it)
        if self._executor is None:
            self._executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="hf_omni_save")
        first = self._executor.submit(copy_all)
        # every rank learnt whether every rank copied: after a failed copy, every rank skips every write alike
        return [first] + [self._executor.submit(named(what, write, first)) for what, write in self._writes]

    def fence(self) -> None:
        """Block until the save in flight has copied what it writes (errors surface at the save's own wait)."""
        if self._staged is not None:
            concurrent.futures.wait([self._staged])

    def hand_off(self, kind: str, payload) -> None:
        """In a write of this save: the writer process writes `payload` (`writer_process.serve`); raised here when
        it fails."""
        self.writer.request(kind, payload)

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown()
            self._executor = None
        if self.writer is not None:
            self.writer.close()
            self.writer = None
        self.staging.release()
