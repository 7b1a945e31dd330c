"""Which optimizer steps the per-module profile times, by Trainer's own count: the ones that end in a log."""

from __future__ import annotations

from transformers import TrainerCallback

from ..metrics.timing_marks import logged_steps


class TimedSteps(TrainerCallback):
    """Trainer's logging steps (`state.logging_steps`: a fraction of the run resolved) and its step count (a resumed
    run's too) for the plugin's profile, so its hooks run during the steps that end in a log and no other."""

    def __init__(self, plugin):
        self.plugin = plugin

    def on_train_begin(self, args, state, control, **kwargs):
        self.plugin.profile.timed = logged_steps(args.logging_strategy, state.logging_steps, args.logging_first_step)

    def on_step_begin(self, args, state, control, **kwargs):
        self.plugin.profile.time_step(state.global_step + 1)
