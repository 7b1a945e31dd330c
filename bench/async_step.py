"""Step time while an async save writes in the background, against the same loop without a save, side by side in
one run: what the background writer (a process of its own) takes from the training loop. One process, CPU.

    python bench/async_step.py [DIR] [ROUNDS]     # DIR: where the checkpoints go (default /tmp/hf_omni_bench/async)

The model is bench/checkpoint.py's (~34M trainable parameters, AdamW: ~0.4 GB a checkpoint). Each round: 5 steps
without a save (their median is the round's quiet step), then `save_state` and steps until its files are written
(at least 3): the steps that ran while it wrote, the first of them (its optimizer step waits for the staging copies),
and the time `save_state` blocked. Ratios are per round; the table gives their median and range.
"""

from __future__ import annotations

import os
import shutil
import statistics
import sys
import time

import torch

from hf_omni.testing.digits import build_model

MODULES = {"vision": {"trainable": False}, "projector": {"learning_rate": 3e-3}, "llm": {"learning_rate": 1e-3}}


def one_step(model, optimizer) -> float:
    start = time.perf_counter()
    batch = {"pixel_values": torch.rand(8, 1, 8, 8), "input_ids": torch.randint(4, 19, (8, 8))}
    batch["labels"] = batch["input_ids"]
    model(**batch).loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return time.perf_counter() - start


def main(root: str, rounds: int) -> None:
    from accelerate import Accelerator

    from hf_omni import OmniPlugin

    shutil.rmtree(root, ignore_errors=True)
    plugin = OmniPlugin(modules=MODULES, defaults={"optim": "adamw_torch", "save_async": True},
                        output_dir=os.path.join(root, "run"))
    model, optimizer, _ = plugin.prepare(Accelerator(cpu=True), build_model(llm_hidden=512, llm_layers=8),
                                         num_training_steps=1000)
    for _ in range(3):
        one_step(model, optimizer)
    plugin.save_state(os.path.join(root, "warmup"))  # the first save allocates the staging buffers (and the writer)
    plugin.wait_for_save()
    rows = {"during": [], "first": [], "blocked": [], "overlapped": []}
    for number in range(rounds):
        quiet = statistics.median(one_step(model, optimizer) for _ in range(5))
        start = time.perf_counter()
        plugin.save_state(os.path.join(root, f"round{number}"))
        blocked = time.perf_counter() - start
        pending = plugin.checkpointer._pending[2]
        steps = []
        while len(steps) < 3 or not all(f.done() for f in pending):
            steps.append(one_step(model, optimizer))
        plugin.wait_for_save()
        rows["during"].append(statistics.mean(steps) / quiet)
        rows["first"].append(steps[0] / quiet)
        rows["blocked"].append(blocked / quiet)
        rows["overlapped"].append(len(steps))
        print(f"round {number}: quiet step {quiet * 1e3:.0f} ms, {len(steps)} steps during the save "
              f"(mean {statistics.mean(steps) * 1e3:.0f} ms, first {steps[0] * 1e3:.0f} ms), "
              f"save_state returned in {blocked * 1e3:.0f} ms")
    plugin.close()
    shutil.rmtree(root, ignore_errors=True)
    print(f"\nbench/async_step.py: {rounds} rounds, {torch.get_num_threads()} threads\n")
    print("| per round | median | range |")
    print("|---|---|---|")
    for key, label in (("during", "step time during a background save / without one"),
                       ("first", "first step after save_state / a step without a save"),
                       ("blocked", "save_state's return / a step without a save"),
                       ("overlapped", "steps run while the save wrote")):
        values = rows[key]
        print(f"| {label} | {statistics.median(values):.2f} | {min(values):.2f}–{max(values):.2f} |")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "/tmp/hf_omni_bench/async", int(sys.argv[2]) if len(sys.argv) > 2 else 3)
