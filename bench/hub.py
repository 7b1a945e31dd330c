"""What a Hub push at every save costs the training loop: `hub_strategy: every_save` pushes each checkpoint in a
background thread (after its marker); the alternative a user could write — push at each save and wait — blocks
the loop for the whole upload. One process, CPU, pushing to a loopback Hub in this process (so the upload costs
CPU here, where a real one mostly waits on the network).

    python bench/hub.py

The model: the demo layout with a larger LLM (~17M parameters, trained in full: ~70 MB per push). Each variant
trains the same steps with the same saves; the stall per save is its extra time over saving without pushing.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time

import huggingface_hub
import torch
from transformers import TrainerCallback

from hf_omni import OmniTrainer, OmniTrainingArguments
from hf_omni.testing import LoopbackHub
from hf_omni.testing.digits import build_model, load_splits

ROUNDS, STEPS, SAVE_EVERY = 3, 13, 4  # saves at 4, 8, 12, each followed by a step
MODULES = {"vision": {"trainable": False}, "projector": {"learning_rate": 3e-3}, "llm": {"learning_rate": 1e-3}}


class SaveGap(TrainerCallback):
    """The loop's time from a save step's end to the next step's start: the save, plus any push it waits for."""

    def __init__(self):
        self.ended, self.gaps = None, []

    def on_step_end(self, args, state, control, **kwargs):
        self.ended = time.perf_counter() if state.global_step % SAVE_EVERY == 0 else None

    def on_step_begin(self, *args, **kwargs):
        if self.ended is not None:
            self.gaps.append(time.perf_counter() - self.ended)
            self.ended = None


class WaitForPush(TrainerCallback):
    """The blocking alternative: after each save, wait until its push is done."""

    def __init__(self):
        self.trainer = None

    def on_save(self, *args, **kwargs):
        self.trainer.hub_push.wait_until_done()


def run(variant: str, out: str, repo: str) -> list[float]:
    torch.manual_seed(0)
    model = build_model(hidden=64, layers=2, llm_hidden=512, llm_layers=4)
    train, _ = load_splits(model.processors["llm"])
    args = OmniTrainingArguments(
        output_dir=out, use_cpu=True, report_to="none", disable_tqdm=True, max_steps=STEPS, save_strategy="steps",
        save_steps=SAVE_EVERY, per_device_train_batch_size=8, modules=MODULES, logging_steps=STEPS,
        push_to_hub=variant != "save only", hub_model_id=repo, hub_strategy="every_save", hub_always_push=True)
    waiter, gap = WaitForPush(), SaveGap()
    trainer = OmniTrainer(model=model, args=args, train_dataset=train,
                          callbacks=[waiter, gap] if variant == "push, waiting" else [gap])
    waiter.trainer = trainer
    trainer.train()
    return gap.gaps


def main():
    huggingface_hub.utils.disable_progress_bars()
    variants = ("save only", "push, waiting", "push in background (every_save)")
    times = {v: [] for v in variants}
    with LoopbackHub() as hub, tempfile.TemporaryDirectory() as tmp:
        for name, value in hub.client_constants(os.path.join(tmp, "cache")).items():
            setattr(huggingface_hub.constants, name, value)
        for r in range(ROUNDS):
            for i, variant in enumerate(variants):
                times[variant].append(run(variant, os.path.join(tmp, f"run{r}{i}"), f"bench/r{r}v{i}"))
        pushed = sum(len(v) for v in hub.files("bench/r0v1-llm").values())
    gaps = {v: statistics.median(g for run_gaps in t for g in run_gaps) for v, t in times.items()}
    print(f"{ROUNDS} rounds x {STEPS // SAVE_EVERY} saves; the LLM's repo is {pushed / 1e6:.0f} MB per push\n")
    print("| variant | loop stopped per save, s (median) | push part of it, s | push part / waiting push's |")
    print("|---|---|---|---|")
    waiting = gaps["push, waiting"] - gaps["save only"]
    for v in variants:
        extra = gaps[v] - gaps["save only"]
        print(f"| {v} | {gaps[v]:.3f} | {extra:.3f} | {extra / waiting:.3f} |")


if __name__ == "__main__":
    main()
