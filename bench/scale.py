"""Checkpoint save and load at 1, 2 and 4 gloo ranks with one module of a few hundred million parameters: per rank
the memory rise during a save and a load, the bytes written and read, the collective bytes received, and times.

    python bench/scale.py              # one launch per layout (fresh processes), a few minutes
    python bench/scale.py --async      # the same with `save_async` (the save's figures then include its wait)

The module: a Llama of ~322M parameters (P = 1.29 GB in fp32), built with `empty_init` from a folder saved once,
fully sharded (or HSDP 2 x 2) with FSDP2, trained one step with AdamW so the checkpoint holds its optimizer
state. Measured per rank, under MALLOC_MMAP_THRESHOLD_=131072 (glibc otherwise keeps freed memory):
- memory rise: VmHWM after `echo 5 > /proc/self/clear_refs` at the start of the save (or load), minus VmRSS there;
  and the peak of RssAnon sampled every 5 ms, minus RssAnon there;
- bytes written: `wchar` of /proc/self/io (every write system call of the process);
- bytes read: what hf_omni's and DCP's safetensors readers request (instrumented: mmap'ed reads are invisible to
  /proc/self/io);
- bytes received through collectives (`hf_omni.testing.collectives.ReceivedBytes`): what tells a rank that
  materialised a whole module apart from one that did not.
Goals (ratios in one run): every rank's save rise <= P / world + max(64 MB, the largest tensor) (`--async`: + its
own shards, parameters and AdamW moments, once more: the staging copy); bytes written per
rank <= 1.5 x total / world; total bytes read at resume <= 1.1 x the checkpoint's bytes.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time

ROOT = "/tmp/hf_omni_bench/scale"
MODEL_DIR = os.path.join(ROOT, "model")
LLAMA = dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=20, num_attention_heads=16,
             num_key_value_heads=16, vocab_size=32000, tie_word_embeddings=False)
LAYOUTS = {"1 rank": (1, None), "full shard (2,)": (2, None), "full shard (4,)": (4, None),
           "HSDP 2x2": (4, {"dp_replicate_size": 2, "dp_shard_size": 2})}
MB = 2**20


def composed_class():
    from hf_omni import OmniModel

    class LanguageModel(OmniModel):
        """One module, `llm`."""

        def forward(self, input_ids, labels=None):
            return self.llm(input_ids=input_ids, labels=labels)

    return LanguageModel


def save_model_once() -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    if os.path.isfile(os.path.join(MODEL_DIR, "config.json")):
        return
    torch.manual_seed(0)
    composed_class().from_modules({"llm": LlamaForCausalLM(LlamaConfig(**LLAMA))}).save_pretrained(MODEL_DIR)


def proc_status(*keys: str) -> dict[str, int]:
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            name, _, value = line.partition(":")
            if name in keys:
                out[name] = int(value.split()[0]) * 1024
    return out


def proc_io(key: str) -> int:
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(key + ":"))


class Measure:
    """Memory rise, bytes written / read / received and wall time of one save or load."""

    def __init__(self, read_counter):
        self.read_counter = read_counter

    def __enter__(self):
        import gc

        from hf_omni.testing.collectives import ReceivedBytes

        gc.collect()
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        start = proc_status("VmRSS", "RssAnon")
        self.rss0, self.anon0, self.anon_peak = start["VmRSS"], start["RssAnon"], start["RssAnon"]
        self.stop = threading.Event()
        self.sampler = threading.Thread(target=self._sample, daemon=True)
        self.sampler.start()
        self.wchar0, self.read0 = proc_io("wchar"), self.read_counter["bytes"]
        self.received = ReceivedBytes().__enter__()
        self.t0 = time.perf_counter()
        return self

    def _sample(self):
        while not self.stop.wait(0.005):
            self.anon_peak = max(self.anon_peak, proc_status("RssAnon")["RssAnon"])

    def __exit__(self, *exc):
        self.seconds = time.perf_counter() - self.t0
        self.received.__exit__()
        self.stop.set()
        self.sampler.join()
        self.anon_peak = max(self.anon_peak, proc_status("RssAnon")["RssAnon"])
        self.figures = {"hwm_rise": proc_status("VmHWM")["VmHWM"] - self.rss0, "anon_rise": self.anon_peak - self.anon0,
                        "written": proc_io("wchar") - self.wchar0, "read": self.read_counter["bytes"] - self.read0,
                        "received": self.received.total, "seconds": self.seconds}


def every_rank(mine: dict) -> list[dict]:
    """Every rank's figures, on every rank (one object all-gather; just this process's without a process group)."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return [mine]
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return everyone


def worker(layout: str, save_async: bool) -> None:
    import torch
    import torch.distributed as dist
    from accelerate import Accelerator

    from hf_omni import OmniPlugin

    world, parallelism = LAYOUTS[layout]
    out = os.path.join(ROOT, "run")
    from hf_omni.testing.reads import count_reads

    read_counter = count_reads()
    llm_entry = {"parallel": "fsdp", **({"parallelism": parallelism} if parallelism else {})}
    plugin = OmniPlugin(modules={"llm": llm_entry}, defaults={"learning_rate": 1e-4, "save_async": save_async},
                        output_dir=out)
    accelerator = Accelerator(cpu=True)
    model = composed_class().from_pretrained(MODEL_DIR, empty_init=True)
    model, optimizer, _ = plugin.prepare(accelerator, model, num_training_steps=10)
    params = sum(p.numel() * p.element_size() for p in model.llm.parameters())  # global sizes (DTensor numel)
    largest = max(p.numel() * p.element_size() for p in model.llm.parameters())
    torch.manual_seed(0)
    ids = torch.randint(0, LLAMA["vocab_size"], (1, 16))
    model(input_ids=ids, labels=ids).loss.backward()
    plugin.clip_grad_norm_()
    optimizer.step()
    optimizer.zero_grad()
    directory = os.path.join(out, "checkpoint")
    barrier = dist.barrier if dist.is_initialized() else (lambda: None)
    barrier()
    with Measure(read_counter) as save:
        plugin.save_state(directory, step=1)
        plugin.wait_for_save()
        barrier()
    with Measure(read_counter) as load:
        plugin.load_state(directory)
        barrier()
    checkpoint_bytes = sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(directory) for f in fs)
    moments = [v for state in plugin.optimizer.optimizers["llm"].state.values() for v in state.values()
               if torch.is_tensor(v)]
    local = [t.to_local() if hasattr(t, "to_local") else t for t in [*model.llm.parameters(), *moments]]
    own = sum(t.numel() * t.element_size() for t in local)  # this rank's shards: parameters + AdamW moments
    mine = {"save": save.figures, "load": load.figures, "own": own}
    everyone = every_rank(mine)
    if not dist.is_initialized() or dist.get_rank() == 0:
        print("RESULT " + json.dumps({"layout": layout, "world": world, "params": params, "largest": largest,
                                      "checkpoint": checkpoint_bytes, "ranks": everyone}))
        shutil.rmtree(out, ignore_errors=True)
    plugin.close()


def run(layout: str, save_async: bool) -> dict:
    world = LAYOUTS[layout][0]
    args = [__file__, "--worker", layout] + (["--async"] if save_async else [])
    cmd = [sys.executable, *args] if world == 1 else ["accelerate", "launch", "--multi_gpu", "--num_processes",
                                                      str(world), "--num_machines", "1", "--mixed_precision", "no",
                                                      "--dynamo_backend", "no", *args]
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072"}
    result = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if result.returncode:
        sys.stderr.write(result.stdout[-3000:] + result.stderr[-6000:])
        raise SystemExit(f"bench/scale.py: {layout} failed")
    line = next(line for line in result.stdout.splitlines() if line.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


def main(save_async: bool) -> None:
    subprocess.run([sys.executable, __file__, "--save-model"], check=True)
    results = [run(layout, save_async) for layout in LAYOUTS]
    params = results[0]["params"]
    print(f"\nbench/scale.py{' --async' if save_async else ''}: one Llama module, P = {params / MB:.0f} MB fp32 "
          f"(largest tensor {results[0]['largest'] / MB:.0f} MB), AdamW state; MB per rank\n")
    print("| layout | rank | save: memory rise (VmHWM / RssAnon) | bound P/world + max(64 MB, largest)"
          f"{' + own shards' if save_async else ''} | written "
          "| total / world | received | save s | load: memory rise | read | load s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    verdicts = []
    for r in results:
        world, bound = r["world"], params / r["world"] + max(64 * MB, r["largest"])
        total_written = sum(rank["save"]["written"] for rank in r["ranks"])
        bounds = [bound + (rank["own"] if save_async else 0) for rank in r["ranks"]]  # async: its shards again
        for i, rank in enumerate(r["ranks"]):
            s, ld = rank["save"], rank["load"]
            print(f"| {r['layout']} | {i} | {s['hwm_rise'] / MB:.0f} / {s['anon_rise'] / MB:.0f} | "
                  f"{bounds[i] / MB:.0f} | "
                  f"{s['written'] / MB:.0f} | {total_written / world / MB:.0f} | {s['received'] / MB:.0f} | "
                  f"{s['seconds']:.2f} | {ld['hwm_rise'] / MB:.0f} / {ld['anon_rise'] / MB:.0f} | "
                  f"{ld['read'] / MB:.0f} | {ld['seconds']:.2f} |")
        worst_rise = max(max(rank["save"]["hwm_rise"], rank["save"]["anon_rise"]) / b for rank, b in zip(r["ranks"],
                                                                                                         bounds))
        worst_written = max(rank["save"]["written"] for rank in r["ranks"])
        total_read = sum(rank["load"]["read"] for rank in r["ranks"])
        verdicts.append((r["layout"], worst_rise, worst_written / (total_written / world),
                         total_read / r["checkpoint"], r["checkpoint"]))
    print("\n| layout | worst save rise / bound (goal <= 1) | worst written / (total / world) (goal <= 1.5) | "
          "read / checkpoint bytes (goal <= 1.1) | checkpoint MB |")
    print("|---|---|---|---|---|")
    for layout, rise, written, read, size in verdicts:
        print(f"| {layout} | {rise:.2f} | {written:.2f} | {read:.2f} | {size / MB:.0f} |")


if __name__ == "__main__":
    if "--save-model" in sys.argv:
        save_model_once()
    elif "--worker" in sys.argv:
        worker(sys.argv[sys.argv.index("--worker") + 1], "--async" in sys.argv)
    else:
        main("--async" in sys.argv)
