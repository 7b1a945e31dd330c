"""Checkpoint cost: OmniPlugin.save_state / load_state vs Accelerate's save_state + save_model, async stall, and
write throughput against dd on the same disk. One process, CPU.

    python bench/checkpoint.py [DIR]        # DIR on the disk to measure (default /tmp/hf_omni_bench/ckpt)

The model: the demo layout with a larger LLM (frozen vision encoder, projector, LLM of ~34M parameters trained in
full with AdamW: ~0.4 GB of state). Each timing includes `os.sync()`, so the bytes are on disk, not in the page
cache.
"""

from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))
from digits import build_model  # noqa: E402

ROUNDS = 3
MODULES = {"vision": {"trainable": False}, "projector": {"learning_rate": 3e-3}, "llm": {"learning_rate": 1e-3}}


def folder_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(r, f)) for r, _, files in os.walk(path) for f in files)


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    os.sync()
    return time.perf_counter() - start


def one_step(model, optimizer):
    batch = {"pixel_values": torch.rand(8, 1, 8, 8), "input_ids": torch.randint(4, 19, (8, 8))}
    batch["labels"] = batch["input_ids"]
    model(**batch).loss.backward()
    optimizer.step()
    optimizer.zero_grad()


def omni_setup(root: str, save_async: bool):
    from accelerate import Accelerator

    from hf_omni import OmniPlugin

    plugin = OmniPlugin(modules=MODULES, defaults={"optim": "adamw_torch", "save_async": save_async},
                        output_dir=root)
    model = build_model(llm_hidden=512, llm_layers=8)
    model, optimizer, _ = plugin.prepare(Accelerator(cpu=True), model, num_training_steps=100)
    one_step(model, optimizer)  # optimizer state exists
    return plugin, model, optimizer


def accelerate_setup():
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    model = build_model(llm_hidden=512, llm_layers=8)
    model.vision.requires_grad_(False)
    optimizer = torch.optim.AdamW([{"params": model.projector.parameters(), "lr": 3e-3},
                                   {"params": model.llm.parameters(), "lr": 1e-3}])
    model, optimizer = accelerator.prepare(model, optimizer)
    one_step(model, optimizer)
    return accelerator, model, optimizer


def main(root: str):
    shutil.rmtree(root, ignore_errors=True)
    os.makedirs(root)
    rows = {"omni_save": [], "omni_load": [], "acc_save": [], "acc_load": [], "async_stall": [], "sync_save": []}
    plugin, model, optimizer = omni_setup(os.path.join(root, "omni_run"), save_async=False)
    accelerator, acc_model, acc_optimizer = accelerate_setup()
    for i in range(ROUNDS):
        ours, theirs = os.path.join(root, f"omni_{i}"), os.path.join(root, f"acc_{i}")
        rows["omni_save"].append(timed(lambda: plugin.save_state(ours)))
        rows["omni_load"].append(timed(lambda: plugin.load_state(ours)))

        def accelerate_save():
            accelerator.save_state(os.path.join(theirs, "state"))
            accelerator.unwrap_model(acc_model).save_pretrained(os.path.join(theirs, "model"))

        rows["acc_save"].append(timed(accelerate_save))
        rows["acc_load"].append(timed(lambda: accelerator.load_state(os.path.join(theirs, "state"))))
    omni_bytes, acc_bytes = folder_bytes(os.path.join(root, "omni_0")), folder_bytes(os.path.join(root, "acc_0"))

    async_plugin, async_model, async_optimizer = omni_setup(os.path.join(root, "async_run"), save_async=True)
    for i in range(ROUNDS):
        target = os.path.join(root, f"async_{i}")
        start = time.perf_counter()
        async_plugin.save_state(target)  # returns while DCP writes the optimizer shards in the background
        rows["async_stall"].append(time.perf_counter() - start)
        one_step(async_model, async_optimizer)  # the loop goes on
        async_plugin.wait_for_save()
        os.sync()
        rows["sync_save"].append(timed(lambda: plugin.save_state(os.path.join(root, f"sync_{i}"))))

    dd_target = os.path.join(root, "dd.bin")
    megabytes = max(100, omni_bytes // 2**20)
    dd_seconds = timed(lambda: subprocess.run(
        ["dd", "if=/dev/zero", f"of={dd_target}", "bs=1M", f"count={megabytes}", "conv=fsync"],
        check=True, capture_output=True))
    print({k: [round(x, 3) for x in v] for k, v in rows.items()})
    med = {k: statistics.median(v) for k, v in rows.items()}
    ours_rate = omni_bytes / med["omni_save"] / 1e9
    dd_rate = megabytes * 2**20 / dd_seconds / 1e9
    print(f"bench/checkpoint.py: {sum(p.numel() for p in model.parameters()) / 1e6:.0f}M parameters "
          f"({sum(p.numel() for n in ('projector', 'llm') for p in getattr(model, n).parameters()) / 1e6:.0f}M "
          f"trainable, AdamW), median of {ROUNDS}, {root}\n")
    print("| | OmniPlugin.save_state / load_state | Accelerator.save_state + save_model / load_state | ratio | goal |")
    print("|---|---|---|---|---|")
    print(f"| save (s) | {med['omni_save']:.2f} | {med['acc_save']:.2f} | {med['omni_save'] / med['acc_save']:.2f} "
          "| <= 1.0 |")
    print(f"| load (s) | {med['omni_load']:.2f} | {med['acc_load']:.2f} | {med['omni_load'] / med['acc_load']:.2f} "
          "| <= 1.0 |")
    print(f"| bytes (MB) | {omni_bytes / 1e6:.0f} | {acc_bytes / 1e6:.0f} | {omni_bytes / acc_bytes:.2f} | <= 1.0 |")
    print(f"| async-save loop stall / sync save | {med['async_stall']:.2f} s | {med['sync_save']:.2f} s | "
          f"{med['async_stall'] / med['sync_save']:.2f} | <= 0.20 |")
    print(f"| write throughput vs dd (conv=fsync, {megabytes} MB) | {ours_rate:.2f} GB/s | {dd_rate:.2f} GB/s | "
          f"{ours_rate / dd_rate:.2f} | >= 0.5 |")
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "/tmp/hf_omni_bench/ckpt")
