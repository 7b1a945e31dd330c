"""`SavePipeline`: the one background thread of async saves, and what it may copy late.

An async save hands every tensor it will write to this thread, which first copies them all (staging), then writes
them, module after module, in the same order on every rank (its DCP collectives on the checkpoint's own gloo
group). The loop goes on meanwhile: parameters and optimizer state change only in the optimizer step, so the step
waits for the copies (`fence()`, which `ModuleOptimizers.step` calls) and the copies overlap the next forward and
backward instead of stalling the loop. Buffers can change in a forward (BatchNorm statistics, DDP's broadcast of
them): they are copied at once. Tensors that belong to no module (a sharded module's gathered weights) are
already private: not copied at all. The late copies go into reused (pinned) buffers on a copy stream of their own
(`staging`).
"""

from __future__ import annotations

import concurrent.futures
from typing import Callable

import torch
from torch import nn

from ..dist import agreed
from ..shards.box import local_of
from .staging import CopyStream, Staging


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
            raise BackgroundWriteError(f"{what}: {type(err).__name__}: {err}") from err

    return job


class SavePipeline:
    def __init__(self):
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._copies: list[Callable[[], None]] = []
        self._writes: list[tuple[str, Callable[[], None]]] = []
        self._staged: concurrent.futures.Future | None = None
        self._params: set[int] = set()
        self._buffers: set[int] = set()
        self.staging, self.stream = Staging(), CopyStream()

    def begin(self, modules: list[nn.Module]) -> None:
        """A new save of `modules` (the previous one finished; its optimizer step issued): learn which storages are
        live parameters and buffers, and mark where the copies may start on the device."""
        self._copies, self._writes = [], []
        self.stream.mark()
        self._params = {storage_of(p) for m in modules for p in m.parameters()}
        self._buffers = {storage_of(b) for m in modules for b in m.buffers()}

    def snapshot(self, tensors: dict[str, torch.Tensor], prefix: str = "") -> Callable[[], dict[str, torch.Tensor]]:
        """`tensors` as they are now, on CPU: buffers copied here, parameters in the pipeline's thread before the
        next optimizer step (into staging buffers named `prefix` + name, reused by the next save), private tensors
        kept. Returns the getter the writes call."""
        out, late = {}, []
        for name, tensor in tensors.items():
            where = storage_of(tensor)
            if where in self._buffers:
                out[name] = copy_to_cpu(tensor)
            elif where in self._params:
                late.append(name)
            else:
                out[name] = tensor.detach().to("cpu").contiguous()

        def copy_late():
            out.update({name: copy_to_cpu(tensors[name], self.staging.buffer(prefix + name, tensors[name]), True)
                        for name in late})

        self._copies.append(copy_late)
        return lambda: out

    def stage(self, stager, state: dict) -> Callable[[], dict]:
        """A DCP state (optimizer tensors; module tensors) copied by `stager` into its reused buffers, in the
        pipeline's thread before the next optimizer step (buffers among them copied here)."""
        if "tensors" in state:
            state = {**state, "tensors": {name: copy_to_cpu(t) if storage_of(t) in self._buffers else t
                                          for name, t in state["tensors"].items()}}
        staged: dict = {}
        self._copies.append(lambda: staged.update(value=stager.stage(state)))
        return lambda: staged["value"]

    def then(self, write: Callable[[], None], what: str) -> None:
        """A write of this save (`what` names it in errors), after every copy, in order."""
        self._writes.append((what, write))

    def start(self, group=None) -> list[concurrent.futures.Future]:
        """Run this save's copies, then its writes, in the background; returns their futures. After the copies every
        rank agrees (on `group`) that every rank copied, so no rank starts a write whose collectives another rank
        would never join; each write is its own job, so one that fails (rank 0's HF files) does not keep the later
        ones (every rank's shards, with their collectives) from running."""
        copies, staged = self._copies, concurrent.futures.Future()
        self._staged = staged
        device = torch.cuda.current_device() if torch.cuda.is_available() else None  # threads start on cuda:0

        def copy_all():
            try:
                if device is not None:
                    torch.cuda.set_device(device)  # the stager's synchronize waits on this rank's own GPU
                with agreed("copying the state of an async save", group), self.stream.copying():
                    for copy in copies:
                        copy()
            finally:
                staged.set_result(None)

        if self._executor is None:
            self._executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="hf_omni_save")
        first = self._executor.submit(copy_all)
        # every rank learnt whether every rank copied: after a failed copy, every rank skips every write alike
        return [first] + [self._executor.submit(named(what, write, first)) for what, write in self._writes]

    def fence(self) -> None:
        """Block until the save in flight has copied what it writes (errors surface at the save's own wait)."""
        if self._staged is not None:
            concurrent.futures.wait([self._staged])

    def close(self) -> None:
        self.staging.release()
        if self._executor is not None:
            self._executor.shutdown()
            self._executor = None
