"""A LoRA module's checkpoints with its frozen base written once per run, side by side with the base rewritten at
every save (the plugin without an `output_dir`, where there is no run folder to hold it): bytes written per rank
and on disk at the first and the second save, save time, and what a resume reads.

    python bench/lora_base.py          # 1 and 2 gloo ranks, each way: four launches, a few minutes

The module: bench/scale.py's Llama (~322M parameters, 1.29 GB in fp32), fully sharded with FSDP2 at 2 ranks,
LoRA r = 16 on q_proj and v_proj (everything else frozen), one AdamW step between the two saves.
Goals: the second save writes <= 5% of what the base-rewriting save writes; a resume reads the base and the
adapter once (read / (base + checkpoint) <= 1.1).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

from scale import MB, MODEL_DIR, ROOT, Measure, composed_class, every_rank

LAYOUTS = {"1 rank": 1, "full shard (2,)": 2}
LORA = {"r": 16, "target_modules": ["q_proj", "v_proj"]}


def folder_bytes(folder: str) -> int:
    return sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(folder) for f in fs)


def worker(world: int, once: bool) -> None:
    import torch
    import torch.distributed as dist
    from accelerate import Accelerator

    from hf_omni import OmniPlugin
    from hf_omni.testing.reads import count_reads

    out = os.path.join(ROOT, "lora_run")
    read_counter = count_reads()
    llm_entry = {"lora": LORA, **({"parallel": "fsdp"} if world > 1 else {})}
    plugin = OmniPlugin(modules={"llm": llm_entry}, defaults={"learning_rate": 1e-4},
                        output_dir=out if once else None)
    accelerator = Accelerator(cpu=True)
    model = composed_class().from_pretrained(MODEL_DIR, empty_init=True)
    model, optimizer, _ = plugin.prepare(accelerator, model, num_training_steps=10)
    barrier = dist.barrier if dist.is_initialized() else (lambda: None)
    figures = {}
    for step in (1, 2):
        torch.manual_seed(step)
        ids = torch.randint(0, 32000, (1, 16))
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        barrier()
        with Measure(read_counter) as save:
            plugin.save_state(os.path.join(out, f"checkpoint-{step}"), step=step)
            barrier()
        figures[f"save{step}"] = save.figures
    with Measure(read_counter) as load:
        plugin.load_state(os.path.join(out, "checkpoint-2"))
        barrier()
    figures["load"] = load.figures
    everyone = every_rank(figures)
    if not dist.is_initialized() or dist.get_rank() == 0:
        frozen = os.path.join(out, "frozen")
        print("RESULT " + json.dumps({"ranks": everyone, "base": folder_bytes(frozen) if os.path.isdir(frozen) else 0,
                                      "checkpoint": folder_bytes(os.path.join(out, "checkpoint-2"))}))
        shutil.rmtree(out, ignore_errors=True)
    plugin.close()


def run(world: int, once: bool) -> dict:
    args = [__file__, "--worker", str(world)] + (["--once"] if once else [])
    cmd = [sys.executable, *args] if world == 1 else ["accelerate", "launch", "--multi_gpu", "--num_processes",
                                                      str(world), "--num_machines", "1", "--mixed_precision", "no",
                                                      "--dynamo_backend", "no", *args]
    result = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072"})
    if result.returncode:
        sys.stderr.write(result.stdout[-3000:] + result.stderr[-6000:])
        raise SystemExit(f"bench/lora_base.py: {world} ranks failed")
    return json.loads(next(line for line in result.stdout.splitlines() if line.startswith("RESULT "))[7:])


def main() -> None:
    subprocess.run([sys.executable, os.path.join(os.path.dirname(__file__), "scale.py"), "--save-model"], check=True)
    print("\nbench/lora_base.py: Llama ~322M, LoRA r=16 on q_proj and v_proj; MB summed over ranks, seconds of the "
          "slowest rank\n")
    print("| layout | base | save 1 written | save 2 written | save 2 s | checkpoint-2 on disk | base on disk | "
          "resume read | save 2 written / rewriting | read / (base + checkpoint) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for layout, world in LAYOUTS.items():
        results = {once: run(world, once) for once in (False, True)}
        second = {once: sum(r["save2"]["written"] for r in res["ranks"]) for once, res in results.items()}
        for once, res in results.items():
            ranks = res["ranks"]
            read = sum(r["load"]["read"] for r in ranks)
            print(f"| {layout} | {'written once' if once else 'rewritten each save'} | "
                  f"{sum(r['save1']['written'] for r in ranks) / MB:.0f} | {second[once] / MB:.1f} | "
                  f"{max(r['save2']['seconds'] for r in ranks):.2f} | {res['checkpoint'] / MB:.1f} | "
                  f"{res['base'] / MB:.0f} | {read / MB:.0f} | {second[once] / second[False]:.3f} | "
                  f"{read / (res['base'] + res['checkpoint']):.2f} |")


if __name__ == "__main__":
    if "--worker" in sys.argv:
        worker(int(sys.argv[sys.argv.index("--worker") + 1]), "--once" in sys.argv)
    else:
        main()
