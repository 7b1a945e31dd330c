"""Step timing shared by the benchmarks: wall time between consecutive optimizer steps."""

from __future__ import annotations

import time


class StepTimer:
    """`tick()` after each optimizer step; `measured(warmup)` drops the first `warmup` steps."""

    def __init__(self):
        self.times, self.last = [], None

    def tick(self):
        now = time.perf_counter()
        if self.last is not None:
            self.times.append(now - self.last)
        self.last = now

    def measured(self, warmup: int) -> list[float]:
        return self.times[warmup - 1:]

    def callback(self):
        """A TrainerCallback that ticks at every optimizer step's end."""
        from transformers import TrainerCallback

        timer = self

        class Tick(TrainerCallback):
            def on_step_end(self, *args, **kwargs):
                timer.tick()

        return Tick()
