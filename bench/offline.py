"""Offline encoding: step time and peak RSS online vs offline, encode throughput vs the encoder's plain forward.

    python bench/offline.py

Two layouts of the digits captioner, vision frozen, LLM with LoRA, projector trained: the stage-2 demo's sizes,
and a heavy encoder (a ViT large enough to be over half of the online step and to see in RSS). Every run is its
own process (a clean peak RSS), builds the model with `empty_init` from one saved export (so the offline run
never allocates the encoder when its cache is valid) and trains the same rows. f is the encoder's share of an
online step, measured in the online run (time inside `encode_image` during the steps); the goal for the step
ratio is (1 - f) + 0.05. Memory: peak RSS, and peak anonymous RSS (sampled at every step end) — the cache is
memory-mapped, so its pages count in RSS but are the OS's page cache, not memory the process holds. Encode throughput: writing the cache (the encoder's batches, rows to Arrow, `save_to_disk`)
against a plain no-grad forward over the same rows (the demo's 1,437; 6 batches of the heavy encoder's), loaded
the same way (a DataLoader with the same collator and batch size), both in the online run after
training (warm), three alternating passes each, medians.
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = "/tmp/hf_omni_bench/offline"
STEPS, BATCH = 40, 64
# encode_rows: the rows timed for encode throughput (all of the demo's; 6 batches of the heavy encoder's)
LAYOUTS = {"stage-2 demo": dict(hidden=64, layers=2, encode_rows=10**9),
           "heavy encoder": dict(hidden=384, layers=24, encode_rows=6 * BATCH)}
MODULES = {"vision": {"trainable": False}, "projector": {"learning_rate": 1e-3},
           "llm": {"learning_rate": 5e-4, "lora": {"r": 8, "target_modules": ["q_proj", "v_proj"]}}}


def child(layout: str, mode: str) -> dict:
    """One run in this process: train STEPS steps online or offline; its step times, peak RSS and more."""
    import torch
    from transformers import TrainerCallback

    from hf_omni import OmniTrainer, OmniTrainingArguments
    from hf_omni.offline import cache as offline_cache
    from hf_omni.testing.digits import Captioner, load_splits

    torch.set_num_threads(2)
    export = os.path.join(ROOT, layout.replace(" ", "_"), "export")
    model = Captioner.from_pretrained(export, empty_init=True)
    train_set, _ = load_splits(model.processors["llm"])
    out = os.path.join(ROOT, layout.replace(" ", "_"), mode)
    args = OmniTrainingArguments(output_dir=out, use_cpu=True, report_to="none", disable_tqdm=True, max_steps=STEPS,
                                 per_device_train_batch_size=BATCH, modules=MODULES, optim="adamw_torch",
                                 save_strategy="no", logging_steps=STEPS, dataloader_drop_last=True,
                                 offline_modules=["vision"] if mode != "online" else None,
                                 offline_cache_dir=os.path.join(ROOT, layout.replace(" ", "_"), "cache"))
    stamps, anon, in_encoder = [], [], []

    class Clock(TrainerCallback):
        def on_step_end(self, *a, **k):
            stamps.append(time.perf_counter())
            with open("/proc/self/status") as f:  # anonymous memory: what the process itself holds
                anon.append(next(int(line.split()[1]) for line in f if line.startswith("RssAnon")) / 1024)

    encode_image = Captioner.encode_image

    @__import__("functools").wraps(encode_image)  # keeps its @offline_encoder declaration
    def timed_image(self, *a, **k):  # the encoder's time inside the online steps: f
        start = time.perf_counter()
        out = encode_image(self, *a, **k)
        in_encoder.append(time.perf_counter() - start)
        return out

    if mode == "online":
        Captioner.encode_image = timed_image
    encoded = []
    original = offline_cache.encode_rows

    def timed_encode(*a, **k):
        start = time.perf_counter()
        rows = original(*a, **k)
        encoded.append(time.perf_counter() - start)
        return rows

    offline_cache.encode_rows = timed_encode
    trainer = OmniTrainer(model=model, args=args, train_dataset=train_set, callbacks=[Clock()])
    trainer.train()
    steps = [b - a for a, b in zip(stamps[4:], stamps[5:])]  # past warm-up
    result = {"step": statistics.median(steps), "rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
              "anon_mb": max(anon), "encode_s": encoded[0] if encoded else None, "rows": len(train_set)}
    if mode == "online":  # the encoder's time inside the steps: its share of the step
        result["encoder"] = statistics.median(in_encoder[5:STEPS])
        Captioner.encode_image = encode_image
        from transformers import default_data_collator

        from hf_omni.offline.spec import offline_encoders

        rows = torch.utils.data.Subset(train_set, range(min(len(train_set), LAYOUTS[layout]["encode_rows"])))
        plain, encode = [], []
        for _ in range(3):  # alternating, medians: this machine's speed drifts between passes
            start = time.perf_counter()  # the plain pass loads the rows as encoding does: a DataLoader, the collator
            with torch.no_grad():
                for batch in torch.utils.data.DataLoader(rows, batch_size=BATCH, collate_fn=default_data_collator):
                    model.encode_image(batch["pixel_values"])
            plain.append(time.perf_counter() - start)
            start = time.perf_counter()  # what encoding does: rows -> encoder batches -> Arrow parts on disk
            offline_cache.write_cache(model, offline_encoders(model)["vision"], rows, os.path.join(out, "encoded"),
                                      {}, default_data_collator, BATCH, "cpu", None)
            encode.append(time.perf_counter() - start)
        result.update(plain_forward_s=statistics.median(plain), encode_s=statistics.median(encode),
                      encoded_rows=len(rows))
    result["encoder_mb"] = sum(p.numel() * p.element_size() for p in
                               __import__("hf_omni.testing.digits", fromlist=["x"]).build_model(**dims(layout)).vision.parameters()) / 2**20
    return result


def dims(layout: str) -> dict:
    d = LAYOUTS[layout]
    return dict(hidden=d["hidden"], layers=d["layers"], llm_hidden=64, llm_layers=2)


def run(layout: str, mode: str) -> dict:
    out = subprocess.run([sys.executable, __file__, "--child", layout, mode], capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(out.stderr[-4000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def main():
    from hf_omni.testing.digits import build_model

    shutil.rmtree(ROOT, ignore_errors=True)
    rows = []
    for layout in LAYOUTS:
        build_model(**dims(layout)).save_pretrained(os.path.join(ROOT, layout.replace(" ", "_"), "export"))
        online, first, cached = run(layout, "online"), run(layout, "offline_first"), run(layout, "offline")
        share = online["encoder"] / online["step"]
        ratio = cached["step"] / online["step"]
        rows.append((layout, online, first, cached, share, ratio))
    print(f"bench/offline.py: {STEPS} steps of {BATCH} rows, median step past warm-up, each run its own process\n")
    print("| layout | encoder MiB | online step (s) | offline step (s) | f (encoder share) | offline / online | goal "
          "(1 - f) + 0.05 | peak RSS online / offline (MiB) | peak anonymous RSS online / offline (MiB) | "
          "anonymous drop / encoder bytes (goal >= 0.9) | encode vs plain forward (samples/s, goal >= 0.8) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for layout, online, first, cached, share, ratio in rows:
        drop = (online["anon_mb"] - cached["anon_mb"]) / online["encoder_mb"]
        enc, plain = online["encoded_rows"] / online["encode_s"], online["encoded_rows"] / online["plain_forward_s"]
        print(f"| {layout} | {online['encoder_mb']:.1f} | {online['step']:.4f} | {cached['step']:.4f} | {share:.2f} | "
              f"{ratio:.2f} | {1 - share + 0.05:.2f} | {online['rss_mb']:.0f} / {cached['rss_mb']:.0f} | "
              f"{online['anon_mb']:.0f} / {cached['anon_mb']:.0f} | {drop:.2f} | {enc:.0f} vs {plain:.0f} "
              f"({enc / plain:.2f}) |")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        print(json.dumps(child(sys.argv[2], sys.argv[3])))
    else:
        main()
