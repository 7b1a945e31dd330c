"""Host copies of an async save, in buffers reused from save to save, filled on a copy stream of their own.

The buffers are pinned when a GPU is there; the copy stream starts after the optimizer step (an event recorded on
the training stream when the save begins), so the copies overlap the next forward and backward instead of queueing
behind them on the default stream. Without CUDA the same calls run with no stream, no event and no pinning: the
path the CPU tests take.
"""

from __future__ import annotations

import contextlib

import torch

from ..shards.box import local_of


class CopyStream:
    """Where the background copies run: `mark()` on the training thread when the save begins, `copying()` around
    the copies in the background thread (its exit waits for them)."""

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
        self.stream.synchronize()


class Staging:
    """Host buffers by name, kept while a tensor keeps its shape and dtype: an async save's copy of the rank's own
    shards, allocated once (pinned with CUDA: page-locked memory the copy engine writes to directly)."""

    def __init__(self):
        self.pinned = torch.cuda.is_available()
        self.buffers: dict[str, torch.Tensor] = {}

    def buffer(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        local = local_of(tensor)
        held = self.buffers.get(name)
        if held is None or held.shape != local.shape or held.dtype != local.dtype:
            held = self.buffers[name] = torch.empty(local.shape, dtype=local.dtype, device="cpu",
                                                    pin_memory=self.pinned)
        return held

    def release(self) -> None:
        self.buffers = {}
