"""Timing marks for the per-module profile (`profile`): CUDA events on a GPU, a host clock with the same interface on
CPU, so the CPU tests run the same code; and which optimizer steps carry the marks."""

from __future__ import annotations

import time
from typing import Callable

import torch


class HostEvent:
    """A CUDA event's interface over `time.perf_counter()` (CPU runs: the host clock is the device clock)."""

    __slots__ = ("at",)

    def __init__(self):
        self.at: float | None = None

    def record(self, stream=None) -> None:
        self.at = time.perf_counter()

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return self.at is not None

    def elapsed_time(self, end: "HostEvent") -> float:
        """Milliseconds from this event to `end`, as `torch.cuda.Event.elapsed_time`."""
        return (end.at - self.at) * 1000.0


def event_factory(device: torch.device):
    """Timing events for `device`: CUDA events, the accelerator's own, or `HostEvent` on CPU."""
    device = torch.device(device)
    if device.type == "cuda":
        return lambda: torch.cuda.Event(enable_timing=True)
    if device.type == "cpu":
        return HostEvent
    return lambda: torch.Event(device=device.type, enable_timing=True)


def logged_steps(strategy: str, every: float, first: bool) -> Callable[[int], bool]:
    """Which optimizer steps (1-based) end in a log under Trainer's logging settings, as its `DefaultFlowCallback`
    decides: every `every`-th step and, with `logging_first_step`, step 1. A strategy whose logging steps are not
    known in advance (`epoch`, a fraction of a run of unknown length) times every step; `no` times none."""
    strategy = str(getattr(strategy, "value", strategy))
    if strategy == "no":
        return lambda step: False
    if strategy != "steps" or every < 1:
        return lambda step: True
    every = int(every)
    return lambda step: step % every == 0 or (first and step == 1)
