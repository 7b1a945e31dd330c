"""Whole copies of a module per rank, at 2 and 4 gloo ranks, each variant in fresh processes:

    python bench/whole_copies.py

The module: a Llama of 168M parameters saved in bf16 (P = 642 MiB in fp32, largest tensor 125 MiB in fp32).
- masters: loaded whole (no `empty_init`), fully sharded with FSDP2 under bf16 compute, so `prepare` makes fp32
  masters of it. Per rank, the memory rise during `prepare_modules` (VmHWM after `clear_refs`, and sampled RssAnon,
  under MALLOC_MMAP_THRESHOLD_=131072), against the bound P / world + L / world + max(64 MiB, the largest tensor),
  L = the loaded module's bytes (bf16: P / 2): `fully_shard` itself copies each rank's shards of the loaded module
  before the cast replaces them, whatever the order. Variants: as
  hf_omni does it (cast on each rank's shards after sharding) and `cast first` (the whole module cast before it is
  sharded, `apply_master_dtype(cast=True)`).
- stripes: built with `empty_init`, held whole by every rank (ddp). Per rank, the bytes read while it is filled
  (hf_omni's safetensors reader, counted), against the module's bytes. Variants: in stripes (as hf_omni does it) and
  `whole` (every rank reads every tensor, `fill_module(replicated=False)`).
Goals: masters rise <= the bound (casting the whole module first adds P on every rank, whatever the world); stripes: total read / module <= 1.1, each rank <= 1 / world + one tensor.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from scale import Measure, every_rank  # noqa: E402  (bench/scale.py's per-rank measures)

ROOT = "/tmp/hf_omni_bench/whole_copies"
MODEL_DIR = os.path.join(ROOT, "model")
LLAMA = dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=8, num_attention_heads=16,
             num_key_value_heads=16, vocab_size=32000, tie_word_embeddings=False)
VARIANTS = ("masters", "masters, cast first", "stripes", "stripes, whole")
MiB = 2**20


def composed_class():
    from hf_omni import OmniModel

    class LanguageModel(OmniModel):
        def forward(self, input_ids, labels=None):
            return self.llm(input_ids=input_ids, labels=labels)

    return LanguageModel


def save_model_once() -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    if os.path.isfile(os.path.join(MODEL_DIR, "config.json")):
        return
    torch.manual_seed(0)
    llm = LlamaForCausalLM(LlamaConfig(**LLAMA)).to(torch.bfloat16)
    composed_class().from_modules({"llm": llm}).save_pretrained(MODEL_DIR)


def worker(variant: str) -> None:
    import torch.distributed as dist
    from accelerate import Accelerator

    from hf_omni import OmniPlugin
    from hf_omni.parallel import driver
    from hf_omni.testing.reads import count_reads

    read_counter = count_reads()
    masters = variant.startswith("masters")
    if variant == "masters, cast first":
        original = driver.apply_master_dtype
        driver.apply_master_dtype = lambda slot, run_dtype, cast=True: original(slot, run_dtype, cast=True)
    if variant == "stripes, whole":
        fill = driver.fill_module
        driver.fill_module = lambda *args, replicated=False: fill(*args, replicated=False)
    plugin = OmniPlugin(modules={"llm": {"parallel": "fsdp" if masters else "ddp"}},
                        defaults={"learning_rate": 1e-4}, output_dir=os.path.join(ROOT, "run"))
    accelerator = Accelerator(cpu=True, mixed_precision="bf16" if masters else "no")
    model = composed_class().from_pretrained(MODEL_DIR, empty_init=not masters)
    dist.barrier()
    with Measure(read_counter) as prepare:
        plugin.prepare_modules(accelerator, model)
        dist.barrier()
    params = [p for p in model.llm.parameters()]
    fp32 = sum(p.numel() * 4 for p in params)  # global sizes (DTensor numel)
    largest = max(p.numel() * 4 for p in params)
    module_bytes = sum(p.numel() * p.element_size() for p in params)
    everyone = every_rank(prepare.figures)
    if dist.get_rank() == 0:
        print("RESULT " + json.dumps({"variant": variant, "world": dist.get_world_size(), "fp32": fp32,
                                      "largest": largest, "module": module_bytes, "ranks": everyone}), flush=True)
    plugin.close()
    dist.destroy_process_group()
    os._exit(0)  # (gloo's teardown in the interpreter's exit aborts now and then: tests/launching.end_distributed)


def run(variant: str, world: int) -> dict:
    cmd = ["accelerate", "launch", "--multi_gpu", "--num_processes", str(world), "--num_machines", "1",
           "--mixed_precision", "no", "--dynamo_backend", "no", __file__, "--worker", variant]
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072"}
    result = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if result.returncode:
        sys.stderr.write(result.stdout[-3000:] + result.stderr[-6000:])
        raise SystemExit(f"bench/whole_copies.py: {variant} at {world} failed")
    line = next(line for line in result.stdout.splitlines() if line.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


def main() -> None:
    subprocess.run([sys.executable, __file__, "--save-model"], check=True)
    print("| variant | world | per rank | bound or goal | ratio (goal <= 1) |")
    print("|---|---|---|---|---|")
    for world in (2, 4):
        for variant in VARIANTS:
            r = run(variant, world)
            sizes = r
            if variant.startswith("masters"):
                bound = r["fp32"] / world + r["fp32"] / 2 / world + max(64 * MiB, r["largest"])
                rises = [max(rank["hwm_rise"], rank["anon_rise"]) for rank in r["ranks"]]
                print(f"| {variant} | {world} | prepare rise {' / '.join(f'{x / MiB:.0f}' for x in rises)} MiB | "
                      f"{bound / MiB:.0f} MiB | {max(rises) / bound:.2f} |", flush=True)
            else:
                reads = [rank["read"] for rank in r["ranks"]]
                bound = r["module"] / world + r["largest"] / 2  # (bf16 files: the largest tensor in bf16)
                print(f"| {variant} | {world} | read {' / '.join(f'{x / MiB:.0f}' for x in reads)} MiB; total / "
                      f"module {sum(reads) / r['module']:.2f} (goal <= 1.1) | {bound / MiB:.0f} MiB | "
                      f"{max(reads) / bound:.2f} |", flush=True)
    print(f"\n{sizes['fp32'] / 4e6:.1f}M parameters: P = {sizes['fp32'] / MiB:.0f} MiB in fp32, the module "
          f"{sizes['module'] / MiB:.0f} MiB in bf16, largest tensor {sizes['largest'] / MiB:.0f} MiB in fp32 "
          "(MiB = 2**20 bytes)")


if __name__ == "__main__":
    if "--save-model" in sys.argv:
        save_model_once()
    elif "--worker" in sys.argv:
        worker(sys.argv[sys.argv.index("--worker") + 1])
    else:
        main()
