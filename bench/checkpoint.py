"""Checkpoint cost: OmniPlugin.save_state / load_state vs Accelerate's save_state + save_model; what an async save
costs the loop, first save of the run included: the time it blocks (`save_state` returning, plus the next optimizer
step's wait for the background copies) and how much the next step slows while the background thread shares the
CPU with it; write throughput against dd, and DCP writer variants side by side. One process, CPU.

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

from hf_omni.testing.digits import build_model

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


def timed_step(model, optimizer) -> float:
    start = time.perf_counter()
    one_step(model, optimizer)
    return time.perf_counter() - start


def dd_rate(target: str, megabytes: int, flag: str) -> float:
    seconds = timed(lambda: subprocess.run(["dd", "if=/dev/zero", f"of={target}", "bs=1M", f"count={megabytes}", flag],
                                           check=True, capture_output=True))
    os.remove(target)
    return megabytes * 2**20 / seconds / 1e9


def writer_rates(optimizer, model, root: str) -> dict:
    """GB/s of DCP writers on the same optimizer state: torch's two, and ours with 1-4 files / threads, buffered or
    O_DIRECT."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter, HuggingFaceStorageWriter

    from hf_omni.checkpoint.state_json import split
    from hf_omni.checkpoint.shard_writer import ShardWriter

    state = {"optimizer": {"state": split(optimizer.state_dict()["llm"], root)[0]}}
    size = sum(t.numel() * t.element_size() for s in state["optimizer"]["state"].values() for t in s.values())
    writers = {
        "torch HuggingFaceStorageWriter (whole file built in memory)":
            lambda d: HuggingFaceStorageWriter(d, save_distributed=True),
        "torch FileSystemWriter (pickled .metadata)": lambda d: FileSystemWriter(d),
        **{f"ShardWriter, {n} file(s) / thread(s)": (lambda d, n=n: ShardWriter(d, threads=n)) for n in (1, 2, 4)},
        **{f"ShardWriter O_DIRECT, {n} file(s) / thread(s)": (lambda d, n=n: ShardWriter(d, threads=n, direct=True))
           for n in (1, 2)},
    }
    seconds: dict = {name: [] for name in writers}
    for _ in range(ROUNDS):
        for name, make in writers.items():
            shutil.rmtree(root, ignore_errors=True)
            os.sync()
            seconds[name].append(timed(lambda: dcp.save(state, storage_writer=make(root))))
    shutil.rmtree(root, ignore_errors=True)
    return {"bytes": size, **{name: size / statistics.median(s) / 1e9 for name, s in seconds.items()}}


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
    from hf_omni.checkpoint.digests import hash_checkpoint
    from hf_omni.checkpoint.contents import file_sizes

    shutil.rmtree(root, ignore_errors=True)
    os.makedirs(root)
    rows = {"omni_save": [], "omni_load": [], "acc_save": [], "acc_load": [], "first_blocked": [], "blocked": [],
            "first_slowed": [], "slowed": [], "sync_save": [], "sha256": []}
    plugin, model, optimizer = omni_setup(os.path.join(root, "omni_run"), save_async=False)
    accelerator, acc_model, acc_optimizer = accelerate_setup()
    for i in range(ROUNDS):
        ours, theirs = os.path.join(root, f"omni_{i}"), os.path.join(root, f"acc_{i}")
        rows["omni_save"].append(timed(lambda: plugin.save_state(ours)))
        rows["omni_load"].append(timed(lambda: plugin.load_state(ours)))
        rows["sha256"].append(timed(lambda: hash_checkpoint(ours, file_sizes(ours), None)))  # verify_checkpoint's cost

        def accelerate_save():
            accelerator.save_state(os.path.join(theirs, "state"))
            accelerator.unwrap_model(acc_model).save_pretrained(os.path.join(theirs, "model"))

        rows["acc_save"].append(timed(accelerate_save))
        rows["acc_load"].append(timed(lambda: accelerator.load_state(os.path.join(theirs, "state"))))
    omni_bytes, acc_bytes = folder_bytes(os.path.join(root, "omni_0")), folder_bytes(os.path.join(root, "acc_0"))

    async_plugin, async_model, async_optimizer = omni_setup(os.path.join(root, "async_run"), save_async=True)
    steps = [timed_step(async_model, async_optimizer) for _ in range(3)]
    fence, waited = async_optimizer.before_step, [0.0]

    def timed_fence():
        start = time.perf_counter()
        fence()
        waited[0] = time.perf_counter() - start

    async_optimizer.before_step = timed_fence
    for i in range(ROUNDS + 1):  # the first save of the run included: its staging buffers are allocated then
        start = time.perf_counter()
        async_plugin.save_state(os.path.join(root, f"async_{i}"))  # returns once buffers are copied
        returned = time.perf_counter() - start
        step = timed_step(async_model, async_optimizer)  # the loop goes on; its optimizer step waits for the copies
        async_plugin.wait_for_save()
        os.sync()
        first = "first_" if i == 0 else ""
        rows[f"{first}blocked"].append(returned + waited[0])
        rows[f"{first}slowed"].append(max(step - waited[0] - statistics.median(steps), 0.0))
        steps.append(timed_step(async_model, async_optimizer))
        rows["sync_save"].append(timed(lambda: plugin.save_state(os.path.join(root, f"sync_{i}"))))
    writers = writer_rates(optimizer, model, os.path.join(root, "writers"))

    megabytes = max(100, omni_bytes // 2**20)
    dd = {flag: dd_rate(os.path.join(root, "dd.bin"), megabytes, flag) for flag in ("conv=fsync", "oflag=direct")}
    print({k: [round(x, 3) for x in v] for k, v in rows.items()})
    med = {k: statistics.median(v) for k, v in rows.items()}
    ours_rate = omni_bytes / med["omni_save"] / 1e9
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
    print(f"| verify_checkpoint: sha256 of every file, added to save and to load (s) | {med['sha256']:.2f} | - | "
          f"{med['sha256'] / med['omni_load']:.1f} x load | - |")
    for key, label, goal in (("first_blocked", "loop blocked (save_state + fence) / sync save, first save", "<= 0.10"),
                             ("blocked", "loop blocked (save_state + fence) / sync save, later saves", "<= 0.10"),
                             ("first_slowed", "next step slowed by the writer sharing the CPU, first save", "-"),
                             ("slowed", "next step slowed by the writer sharing the CPU, later saves", "-")):
        print(f"| {label} | {med[key]:.3f} s | {med['sync_save']:.2f} s | {med[key] / med['sync_save']:.3f} | "
              f"{goal} |")
    print(f"| write throughput vs dd conv=fsync ({megabytes} MB) | {ours_rate:.2f} GB/s | "
          f"{dd['conv=fsync']:.2f} GB/s | {ours_rate / dd['conv=fsync']:.2f} | >= 0.5 |")
    print(f"\noptimizer-state writers (dcp.save of {writers.pop('bytes') / 1e6:.0f} MB, median of {ROUNDS}, "
          f"to os.sync()), against dd oflag=direct {dd['oflag=direct']:.2f} GB/s:\n")
    print("| writer | GB/s | vs dd oflag=direct |")
    print("|---|---|---|")
    for name, rate in writers.items():
        print(f"| {name} | {rate:.2f} | {rate / dd['oflag=direct']:.2f} |")
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "/tmp/hf_omni_bench/ckpt")
