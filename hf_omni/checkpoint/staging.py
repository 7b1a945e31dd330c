"""Host copies of an async save, in shared buffers reused from save to save, filled on a copy stream of their own.

The buffers are pinned when a GPU is there; the copy stream starts after the optimizer step (an event recorded on
the training stream when `save_state` has issued its device work), so the copies overlap the next forward and backward instead of queueing
behind them on the default stream. Without CUDA the same calls run with no stream, no event and no pinning: the
path the CPU tests take.
"""

from __future__ import annotations

import bisect
import contextlib
import math
import os
import secrets

import torch

from ..shards.box import local_of


class CopyStream:
    """Where the background copies run: `mark()` on the training thread once the save has issued its device work,
    `copying()` around the copies in the background thread. Ordered by events alone: the copy stream waits for the
    event `mark()` recorded on the training stream; the exit records an event after the copies and waits for that
    one (the hand-off to the writes), never for the whole device."""

    def __init__(self):
        self.cuda = torch.cuda.is_available()
        self.stream = torch.cuda.Stream() if self.cuda else None
        self.after = None

    def mark(self) -> None:
        if self.cuda:
            self.after = torch.cuda.Event()
            self.after.record()  # on the training thread's current stream: after its optimizer step

    @contextlib.contextmanager
    def copying(self):
        if not self.cuda:
            yield
            return
        with torch.cuda.stream(self.stream):
            if self.after is not None:
                self.stream.wait_event(self.after)
            yield
            copied = torch.cuda.Event()
            copied.record(self.stream)
        copied.synchronize()


SHM = "/dev/shm"


def sweep() -> None:
    """Buffer files left in /dev/shm by a process killed between a buffer's allocation and its mapping by the
    writer (`hf_omni_<pid>_<n>_<random>` of a pid that is gone) are removed."""
    for name in os.listdir(SHM) if os.path.isdir(SHM) else []:
        if not name.startswith("hf_omni_"):
            continue
        pid = name.split("_")[2]
        if pid.isdigit() and not os.path.exists(f"/proc/{pid}"):
            with contextlib.suppress(FileNotFoundError):  # another rank's sweep took it first
                os.unlink(os.path.join(SHM, name))


class Staging:
    """Host buffers by name, kept while a tensor keeps its shape and dtype: an async save's copy of the rank's own
    shards, allocated once (pinned with CUDA: page-locked memory the copy engine writes to directly). `shared`:
    each buffer is a file in /dev/shm mapped shared, which the writer process maps too (`fresh()` lists the ones it
    has not mapped yet, `mapped()` unlinks their files once it has: the memory lives as long as the mappings)."""

    def __init__(self, shared: bool = False):
        self.pinned, self.shared = torch.cuda.is_available(), shared
        self.buffers: dict[str, torch.Tensor] = {}
        self._fresh: dict[str, tuple[str, int]] = {}
        self._count, self._by_start = 0, None
        if shared:
            sweep()

    def buffer(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        local = local_of(tensor)
        held = self.buffers.get(name)
        if held is None or held.shape != local.shape or held.dtype != local.dtype:
            if held is not None:
                self._unpin(held)
            held = self.buffers[name] = self._allocate(name, local.shape, local.dtype)
            self._by_start = None
        return held

    def _allocate(self, name: str, shape, dtype) -> torch.Tensor:
        if not self.shared:
            return torch.empty(shape, dtype=dtype, device="cpu", pin_memory=self.pinned)
        nbytes = max(1, math.prod(shape) * dtype.itemsize)
        self._count += 1
        path = f"{SHM}/hf_omni_{os.getpid()}_{self._count}_{secrets.token_hex(4)}"  # a reused pid's leftover: no clash
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:  # pages reserved now: a full /dev/shm is an OSError here, not a SIGBUS at the copy
            os.posix_fallocate(fd, 0, nbytes)
        except OSError as err:
            os.unlink(path)
            raise OSError(err.errno, f"{SHM} cannot hold the {nbytes} bytes staging {name!r} of an async save (a "
                                     f"container's /dev/shm: --shm-size): {err.strerror}") from None
        finally:
            os.close(fd)
        raw = torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)
        self._fresh[name] = (path, nbytes)
        if self.pinned:  # page-locked in place: the copy engine writes into the shared pages
            torch.cuda.cudart().cudaHostRegister(raw.data_ptr(), nbytes, 0)
        return raw[:math.prod(shape) * dtype.itemsize].view(dtype).view(shape)

    def _unpin(self, held: torch.Tensor) -> None:
        if self.shared and self.pinned:
            torch.cuda.cudart().cudaHostUnregister(held.untyped_storage().data_ptr())

    def fresh(self) -> list[tuple[str, str, int]]:
        """(name, path, bytes) of the buffers the writer process has not mapped yet."""
        return [(name, path, nbytes) for name, (path, nbytes) in self._fresh.items()]

    def mapped(self) -> None:
        """The writer process mapped every fresh buffer: their files go (the memory stays while mapped)."""
        for path, _ in self._fresh.values():
            os.unlink(path)
        self._fresh = {}

    def ref(self, tensor: torch.Tensor) -> tuple[str, int, list[int], str]:
        """A staged tensor (a buffer or a contiguous view into one) as the writer process names it: (buffer name, byte
        offset, shape, dtype)."""
        if self._by_start is None:
            self._by_start = sorted((b.untyped_storage().data_ptr(), n) for n, b in self.buffers.items())
        local = local_of(tensor)
        if not local.numel():
            return None, 0, list(local.shape), str(local.dtype)
        at = bisect.bisect_right(self._by_start, (local.data_ptr(), chr(0x10FFFF))) - 1
        start, name = self._by_start[at] if at >= 0 else (0, None)
        end = start + (self.buffers[name].untyped_storage().nbytes() if name is not None else 0)
        if not local.is_contiguous() or local.data_ptr() + local.numel() * local.element_size() > end:
            raise ValueError(f"a tensor of shape {list(local.shape)} is not a staged buffer's contiguous part")
        return name, local.data_ptr() - start, list(local.shape), str(local.dtype)

    def release(self) -> None:
        for held in self.buffers.values():
            self._unpin(held)
        for path, _ in self._fresh.values():
            os.unlink(path)
        self.buffers, self._fresh, self._by_start = {}, {}, None
