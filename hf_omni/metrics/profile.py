"""Per-module time at logging steps: `time/<module>`, the seconds of forward + backward of the optimizer steps
that end in a log.

Why: choosing `ddp` / `fsdp` / HSDP per module, and finding the module that costs the step, needs each module's
own time; and it must not cost the training step anything it can avoid. So the hooks are on only during the steps
that end in a log (`timing_marks.logged_steps`: a step that is not logged runs none of them), those steps only
*record* timing marks (on CUDA `torch.cuda.Event(enable_timing=True)` on the current stream; on CPU `HostEvent`, a
`time.perf_counter()` with the same interface, so the CPU tests run the same code), and only `logs()` — called at
logging steps — reads them: one `synchronize()` of the last mark, then `elapsed_time` of each pair. Nothing here
reads a device value on any other step (no `.item()`, no `float(tensor)`, no `synchronize`).

Where the marks are, per call of a module (`module(...)`; a method that calls a submodule directly, such as
`llm.get_input_embeddings()(ids)`, is outside it):

- forward: a forward pre-hook run before any other (before FSDP2's all-gather, replicate's buffer broadcast) to a
  forward hook run after all others (after FSDP2's reshard). Calls while no trained module is in training mode
  (evaluation) are not recorded.
- backward start: the first gradient reaching any of the call's outputs (`register_multi_grad_hook(mode="any")`,
  attached before FSDP2's pre-backward hook, so its all-gather for backward counts).
- backward end: every gradient of the call's inputs that need one computed (`register_multi_grad_hook(mode="all")`
  on the inputs as given, before FSDP2 / replicate see them: after FSDP2's post-backward has issued its
  reduce-scatter). A call whose inputs need no gradient (the first trained module on its path, e.g. a tower fed
  pixels), or none of whose inputs got one, ends with the backward pass (autograd's queued callback): its
  parameters' gradients are the last computed on its path; a concurrent branch that finishes after it counts too.
- a module with no gradient through it (frozen, inputs need none): forward only.
- activation checkpointing: recompute inside a module (transformers' per-layer checkpointing, what
  `activation_checkpointing` turns on) is part of that module's backward; a forward of a module that runs while its
  own backward is running (a checkpoint around the whole module, recomputing it) is not recorded again.

Offline modules (on the meta device) are skipped. `close()` removes every hook.
"""

from __future__ import annotations

import torch
from torch.autograd.graph import register_multi_grad_hook

from ..compat import queue_backward_callback
from ..modules.units import run_roots
from .timing_marks import HostEvent, event_factory, logged_steps  # noqa: F401  (HostEvent: re-exported)

FOLD_AFTER = 256  # calls of a module held before the finished ones are folded into milliseconds


def tensors_in(value) -> list[torch.Tensor]:
    """The tensors in a module's inputs or outputs (tensors, tuples / lists, dicts and `ModelOutput`s)."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (list, tuple)):
        return [t for item in value for t in tensors_in(item)]
    return []


def needing_grad(value) -> list[torch.Tensor]:
    return [t for t in tensors_in(value) if t.requires_grad]


class Call:
    """One call of a module: its forward pair and, once its backward ran, its backward pair."""

    __slots__ = ("forward", "backward_start", "backward_end")

    def __init__(self, start):
        self.forward, self.backward_start, self.backward_end = [start, None], None, None


class ModuleTimer:
    """The hooks on one module and its calls since the last read."""

    def __init__(self, name: str, module: torch.nn.Module, profile: "ModuleProfile"):
        self.name, self.profile = name, profile
        self.calls: list[Call] = []
        self.folded = 0.0  # milliseconds of calls folded since the last read
        self.open: list[Call | None] = []  # forwards in progress (None: one not recorded)
        self.in_backward = 0  # this module's backward passes running now (a forward meanwhile is a recompute)
        self.module, self.handles = module, []

    def hook(self) -> None:
        """The hooks on (a timed step): the pre-hook first and the outputs' watch before any other forward hook,
        whatever was registered before (FSDP2, replicate); an adopted model's on what runs (`run_roots`)."""
        if not self.handles:
            self.handles = [handle for unit in run_roots(self.module) for handle in (
                unit.register_forward_pre_hook(self.before_forward, prepend=True, with_kwargs=True),
                unit.register_forward_hook(self.watch_outputs, prepend=True),
                unit.register_forward_hook(self.after_forward, always_call=True))]

    def before_forward(self, module, args, kwargs) -> None:
        if self.in_backward or not self.profile.training():
            self.open.append(None)
            return
        call = Call(self.profile.mark())
        self.open.append(call)
        if torch.is_grad_enabled():
            inputs = needing_grad((args, kwargs))
            if inputs:
                register_multi_grad_hook(inputs, lambda grads, call=call: self.backward_ended(call), mode="all")

    def watch_outputs(self, module, args, output) -> None:
        call = self.open[-1] if self.open else None
        outputs = needing_grad(output) if call is not None else []
        if outputs:
            register_multi_grad_hook(outputs, lambda grad, call=call: self.backward_started(call), mode="any")

    def after_forward(self, module, args, output) -> None:
        call = self.open.pop() if self.open else None
        if call is not None:
            call.forward[1] = self.profile.mark()
            self.calls.append(call)

    def backward_started(self, call: Call) -> None:
        if call.backward_start is not None:
            return
        call.backward_start = self.profile.mark()
        self.in_backward += 1
        # the end of the pass: the end where no input needs a gradient (else the inputs' hook comes first)
        queue_backward_callback(lambda: self.backward_ended(call))

    def backward_ended(self, call: Call) -> None:
        if call.backward_start is None or call.backward_end is not None:
            return
        call.backward_end = self.profile.mark()
        self.in_backward = max(0, self.in_backward - 1)

    @staticmethod
    def call_pairs(call: Call) -> list[tuple]:
        """A call's (start, end) marks: its forward, and its backward once that ended."""
        return [tuple(call.forward)] + ([(call.backward_start, call.backward_end)] if call.backward_end else [])

    def pairs(self) -> list[tuple]:
        """The (start, end) marks of every finished forward and backward since the last read."""
        return [pair for call in self.calls for pair in self.call_pairs(call)]

    def fold(self) -> None:
        """After an optimizer step (every backward of it over): calls whose marks the device has passed
        (`query()`, no wait) become milliseconds in `folded` and their marks are dropped, so a run that logs rarely
        holds a bounded number of marks."""
        kept = []
        for call in self.calls:
            pairs = self.call_pairs(call)
            if all(mark.query() for pair in pairs for mark in pair):
                self.folded += sum(start.elapsed_time(end) for start, end in pairs)
            else:
                kept.append(call)
        self.calls = kept

    def close(self) -> None:
        """The hooks off (a step that is not timed, the end of training)."""
        for handle in self.handles:
            handle.remove()
        self.handles, self.open, self.in_backward = [], [], 0

    def __deepcopy__(self, memo) -> "ModuleTimer":
        """A copy of the module (an EMA, a reference model) is not timed: its copied hooks get an inert timer."""
        inert = object.__new__(ModuleTimer)
        inert.name, inert.profile, inert.calls, inert.open, inert.in_backward, inert.handles, inert.module = (
            self.name, NOT_TRAINING, [], [], 0, [], None)
        return inert


class NotTraining:
    """The profile of a copied module's hooks: never training, so nothing is recorded."""

    @staticmethod
    def training() -> bool:
        return False


NOT_TRAINING = NotTraining()


class ModuleProfile:
    """Timing hooks on every live module of `slots` (name -> `ModuleSlot`) during the optimizer steps `timed`
    names (1-based; by default every step); `logs()` at logging steps.

    The hooks are on only while a timed step runs: a step that is not timed runs no hook of the profile at all.
    `stepped()` (`ModuleOptimizers.after_step`: every step, an fp16 one it skipped too) counts the steps, and turns
    the hooks on or off for the next one; `logs()` divides each module's time since the last call by the timed
    steps among them. A loop whose step count is not the profile's own (a resumed Trainer) says which step comes
    next with `time_step()`."""

    def __init__(self, slots: dict, device, timed=None):
        self.new_event = event_factory(device)
        self.timed = timed if timed is not None else (lambda step: True)
        self.last = None  # the last mark recorded: what `logs()` synchronises on
        self.step = 0  # optimizer steps done
        self.steps = 0  # timed steps since the last read
        self.timing = False  # the step running now is timed
        self.trained = [slot.module for slot in slots.values() if slot.trains and slot.kind != "offline"]
        self.timers = {name: ModuleTimer(name, slot.module, self) for name, slot in slots.items()
                       if slot.kind != "offline" and not any(p.is_meta for p in slot.module.parameters())}
        self.time_step(1)

    @classmethod
    def for_args(cls, slots: dict, device, args) -> "ModuleProfile":
        """Timing the steps that end in a log under `args`' logging settings (`timing_marks.logged_steps`)."""
        return cls(slots, device, logged_steps(args.logging_strategy, args.logging_steps, args.logging_first_step))

    def time_step(self, step: int) -> None:
        """Step `step` (1-based) runs next: the hooks on if it is timed, off if not."""
        self.step, self.timing = step - 1, bool(self.timers) and bool(self.timed(step))
        for timer in self.timers.values():
            timer.hook() if self.timing else timer.close()

    def training(self) -> bool:
        """Some trained module is in training mode (Trainer's `model.eval()` for evaluation turns them all off)."""
        return any(module.training for module in self.trained)

    def mark(self):
        event = self.new_event()
        event.record()
        self.last = event
        return event

    def stepped(self, *_) -> None:
        self.steps += self.timing
        for timer in self.timers.values():  # every backward of the step is over
            timer.in_backward = 0
            if len(timer.calls) > FOLD_AFTER:
                timer.fold()
        self.time_step(self.step + 2)

    def logs(self) -> dict[str, float]:
        """`{"time/<module>": mean seconds of forward + backward per timed optimizer step}` since the last call,
        then reset; `{}` before any timed step. The one place that reads the marks."""
        if not self.steps:
            return {}
        if self.last is not None:
            self.last.synchronize()
        out = {}
        for name, timer in self.timers.items():
            milliseconds = timer.folded + sum(start.elapsed_time(end) for start, end in timer.pairs())
            out[f"time/{name}"] = milliseconds / 1000.0 / self.steps
            timer.calls, timer.folded = [], 0.0
        self.steps, self.last = 0, None
        return out

    def close(self) -> None:
        """Every hook removed (the end of training)."""
        for timer in self.timers.values():
            timer.close()
        self.timers = {}
