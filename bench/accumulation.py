"""Gradient accumulation under FSDP at 4 gloo ranks: what each rank holds with and without sync inside a window.

    python bench/accumulation.py       # one `accelerate launch` of 4 ranks, a few minutes

One module, a Llama of ~100M parameters in fp32, fully sharded over 4 ranks, trained 3 optimizer steps on the same
global batch of 16 rows three ways, one after another in the same processes:
- accumulation 1 (16 rows at once: 4 per rank);
- accumulation 4 with `sync_each_batch` unset (FSDP's default: reduce-scatter on every micro-step);
- accumulation 4 with `sync_each_batch: false` (no sync until the window's last micro-step).
Per rank, under MALLOC_MMAP_THRESHOLD_=131072 (glibc otherwise keeps freed memory): the peak RSS rise during
training (VmHWM after `echo 5 > /proc/self/clear_refs` at train start, minus VmRSS there), and the peak gradient
bytes held (the storage behind the module's gradients, FSDP's unsharded ones included, after every backward:
tests/held_gradients.py). Goal: accumulation 4 (default) <= 1.1 x accumulation 1 on both; losses equal (1e-5).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = "/tmp/hf_omni_bench/accumulation"
LLAMA = dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=11, num_attention_heads=12,
             num_key_value_heads=12, vocab_size=8000, tie_word_embeddings=False)
RUNS = {"accumulation 1": (1, None), "accumulation 4": (4, None), "accumulation 4, sync_each_batch: false": (4, False)}
GLOBAL_BATCH, STEPS, WORLD, MB = 16, 3, 4, 2**20


def vm(key: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key + ":"))


def worker() -> None:
    sys.path[:0] = [os.path.join(ROOT, "tests")]
    import torch
    import torch.distributed as dist
    from held_gradients import sample_after_backward
    from transformers import LlamaConfig, LlamaForCausalLM, TrainerCallback

    from hf_omni import OmniModel, OmniTrainer, OmniTrainingArguments

    class LanguageModel(OmniModel):
        def forward(self, input_ids, labels=None, **kwargs):
            return self.llm(input_ids=input_ids, labels=labels, **kwargs)

    class Rows(torch.utils.data.Dataset):
        def __init__(self):
            self.ids = torch.randint(0, LLAMA["vocab_size"], (GLOBAL_BATCH * STEPS, 32),
                                     generator=torch.Generator().manual_seed(0))

        def __len__(self):
            return len(self.ids)

        def __getitem__(self, i):
            return {"input_ids": self.ids[i], "labels": self.ids[i]}

    class PeakFromTrainStart(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            self.rss0 = vm("VmRSS")

    results = {}
    for name, (accumulation, sync) in RUNS.items():
        torch.manual_seed(0)
        model = LanguageModel.from_modules({"llm": LlamaForCausalLM(LlamaConfig(**LLAMA))})
        module = {"parallel": "fsdp", "learning_rate": 1e-4}
        if sync is not None:
            module["sync_each_batch"] = sync
        args = OmniTrainingArguments(
            output_dir=os.path.join(OUT, "run"), use_cpu=True, report_to="none", save_strategy="no",
            disable_tqdm=True, logging_steps=1, max_steps=STEPS, optim="adamw_torch", seed=0,
            train_sampling_strategy="sequential", dataloader_drop_last=True, modules={"llm": module},
            per_device_train_batch_size=GLOBAL_BATCH // WORLD // accumulation,
            gradient_accumulation_steps=accumulation)
        peak = PeakFromTrainStart()
        trainer = OmniTrainer(model=model, args=args, train_dataset=Rows(), callbacks=[peak])
        held = sample_after_backward(trainer, {"llm": model.llm})
        trainer.train()
        mine = {"rise": vm("VmHWM") - peak.rss0, "held": max(held["llm"]),
                "losses": [e["loss"] for e in trainer.state.log_history if "loss" in e],
                "params": sum(p.numel() for p in model.llm.parameters())}
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
        results[name] = everyone
        del trainer, model
    if dist.get_rank() == 0:
        print("RESULT " + json.dumps(results))


def main() -> None:
    cmd = ["accelerate", "launch", "--multi_gpu", "--num_processes", str(WORLD), "--num_machines", "1",
           "--mixed_precision", "no", "--dynamo_backend", "no", __file__, "--worker"]
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072", "OMP_NUM_THREADS": "1"}
    result = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if result.returncode:
        sys.stderr.write(result.stdout[-3000:] + result.stderr[-6000:])
        raise SystemExit("bench/accumulation.py: the launch failed")
    line = next(x for x in result.stdout.splitlines() if x.startswith("RESULT "))
    results = json.loads(line[len("RESULT "):])
    base = results["accumulation 1"]
    params = base[0]["params"]
    print(f"Llama of {params / 1e6:.0f}M parameters ({params * 4 / MB:.0f} MB in fp32), full shard over {WORLD} "
          f"gloo ranks, global batch {GLOBAL_BATCH}, {STEPS} steps")
    print("| run | peak RSS rise per rank, MB (worst) | / accumulation 1 | peak gradient bytes held per rank, MB "
          "| / accumulation 1 | max loss difference to accumulation 1 |")
    print("|---|---|---|---|---|---|")
    for name, ranks in results.items():
        rise, held = max(r["rise"] for r in ranks), max(r["held"] for r in ranks)
        base_rise, base_held = max(r["rise"] for r in base), max(r["held"] for r in base)
        diff = max(abs(a - b) for a, b in zip(ranks[0]["losses"], base[0]["losses"]))
        print(f"| {name} | {rise / MB:.0f} | {rise / base_rise:.2f} | {held / MB:.1f} | {held / base_held:.2f} "
              f"| {diff:.1e} |")


if __name__ == "__main__":
    worker() if "--worker" in sys.argv else main()
