"""Per-module FSDP2 on CPU (2 gloo ranks): step time against a hand-written loop, and peak memory per rank.

    python bench/fsdp.py                # launches its parts with accelerate; takes a few minutes
    python bench/fsdp.py --only memory  # parts 2 and 3 only (--only step: part 1 only)

1. Step time, the demo model with the LLM sharded (frozen vision encoder, replicated projector): OmniTrainer vs
   a hand-written loop (`fully_shard` on the same units, composable `replicate`, one AdamW per module, per-module
   clipping, the same token normalisation), interleaved over rounds. Goal: ratio <= 1.03.
2. Peak RSS per rank of the demo layout with a ~150M-parameter LLM trained in full: OmniTrainer with the LLM
   sharded and the model built with `empty_init`, vs plain `Trainer` with DDP over the whole model (built
   normally), each in fresh processes, with glibc's default allocator and with MALLOC_MMAP_THRESHOLD_=131072
   (glibc otherwise keeps freed memory), side by side in the same run. Goal: ratio <= 0.60.
3. The price of fp32 master weights: the same LLM saved in bf16 and trained under `bf16: true`, `master_dtype`
   auto (fp32 masters) vs bfloat16: the bytes of the LLM's parameters, gradients and AdamW state one rank holds,
   and peak RSS per rank. Theory: 16 bytes per parameter against 8, divided by the ranks.
"""

from __future__ import annotations

import os
import resource
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))
from launching import end_distributed, free_port  # noqa: E402
from timing import StepTimer  # noqa: E402

WARMUP, MEASURED, ROUNDS, BATCH = 5, 40, 3, 64
BIG = dict(hidden=64, layers=2, llm_hidden=768, llm_layers=16)  # the LLM: ~151M parameters
BIG_DIR = "/tmp/hf_omni_bench/big_model"
BIG_BF16_DIR = "/tmp/hf_omni_bench/big_model_bf16_llm"  # the same with its LLM saved in bf16 (a released LLM)
MODULES = {"vision": {"trainable": False}, "projector": {"learning_rate": 3e-3},
           "llm": {"learning_rate": 1e-3, "parallel": "fsdp"}}


def launch(*args: str, env: dict | None = None) -> str:
    """The workers on 2 gloo ranks, with the caller's environment plus `env` (an allocator setting of the caller's
    is dropped: each variant states its own)."""
    cmd = ["accelerate", "launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1",
           "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", str(free_port()),
           __file__, *args]
    base = {k: v for k, v in os.environ.items() if not k.startswith(("ACCELERATE_", "FSDP_", "MALLOC_"))}
    result = subprocess.run(cmd, capture_output=True, text=True, env={**base, **(env or {})})
    if result.returncode:
        sys.stderr.write(result.stdout[-3000:] + result.stderr[-6000:])
        raise SystemExit(f"bench/fsdp.py {' '.join(args)} failed")
    return result.stdout


# -- 1. step time ---------------------------------------------------------------------------------

def run_omni(train_set, steps):
    from hf_omni import OmniTrainer, OmniTrainingArguments
    from hf_omni.testing.digits import build_model

    timer = StepTimer()
    args = OmniTrainingArguments(
        output_dir="/tmp/hf_omni_bench/fsdp_omni", max_steps=steps, per_device_train_batch_size=BATCH,
        learning_rate=1e-3, lr_scheduler_type="constant", optim="adamw_torch", use_cpu=True, report_to="none",
        save_strategy="no", disable_tqdm=True, logging_steps=10_000, dataloader_drop_last=True, modules=MODULES)
    OmniTrainer(model=build_model(), args=args, train_dataset=train_set, callbacks=[timer.callback()]).train()
    return timer.measured(WARMUP)


def run_by_hand(train_set, steps):
    import torch
    import torch.distributed as dist
    from accelerate import Accelerator
    from torch.distributed._composable.replicate import replicate
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    from hf_omni.testing.digits import build_model

    accelerator = Accelerator(cpu=True)
    model = build_model()
    model.vision.requires_grad_(False)
    model.vision.eval()
    replicate(model.projector, find_unused_parameters=True)  # OmniTrainer's default for a ddp module, as Trainer's
    replicate.state(model.projector).lazy_init()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in model.llm.modules():
        if isinstance(layer, LlamaDecoderLayer):
            fully_shard(layer, mesh=mesh)
    fully_shard(model.llm.get_input_embeddings(), mesh=mesh)
    fully_shard(model.llm, mesh=mesh)
    model.llm._get_fsdp_state()._lazy_init()  # the embeddings run before the llm's root
    optimizers = {"projector": torch.optim.AdamW(model.projector.parameters(), lr=3e-3),
                  "llm": torch.optim.AdamW(model.llm.parameters(), lr=1e-3)}
    loader = accelerator.prepare(torch.utils.data.DataLoader(train_set, batch_size=BATCH, shuffle=True,
                                                             drop_last=True))
    timer, step = StepTimer(), 0
    model.train()
    model.vision.eval()
    while step < steps:
        for batch in loader:
            num_items = (batch["labels"] != -100).sum()
            dist.all_reduce(num_items)
            loss = model(**batch, num_items_in_batch=num_items).loss * dist.get_world_size()
            loss.backward()
            for name, opt in optimizers.items():
                grads = [p.grad for p in getattr(model, name).parameters() if p.grad is not None]
                norm = torch.nn.utils.get_total_norm(grads)
                norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
                torch.nn.utils.clip_grads_with_norm_(list(getattr(model, name).parameters()), 1.0, norm)
                opt.step()
                opt.zero_grad()
            timer.tick()
            step += 1
            if step == steps:
                break
    return timer.measured(WARMUP)


def step_time_worker():
    import torch.distributed as dist

    from hf_omni.testing.digits import build_tokenizer, load_splits

    train_set, _ = load_splits(build_tokenizer())
    times = {"omni": [], "by_hand": []}
    for _ in range(ROUNDS):
        times["omni"] += run_omni(train_set, WARMUP + MEASURED)
        dist.barrier()
        times["by_hand"] += run_by_hand(train_set, WARMUP + MEASURED)
        dist.barrier()
    if dist.get_rank() == 0:
        med = {k: statistics.median(v) * 1000 for k, v in times.items()}
        print(f"STEP omni={med['omni']:.2f} by_hand={med['by_hand']:.2f}")


# -- 2. memory ------------------------------------------------------------------------------------
def save_big_model():
    import torch

    from hf_omni.testing.digits import build_model

    if not os.path.isfile(os.path.join(BIG_DIR, "config.json")):
        build_model(**BIG).save_pretrained(BIG_DIR)
    if not os.path.isfile(os.path.join(BIG_BF16_DIR, "config.json")):
        model = build_model(**BIG)
        model.llm.to(torch.bfloat16)
        model.save_pretrained(BIG_BF16_DIR)


def held_bytes(module, optimizer) -> int:
    """Bytes this rank holds of `module`'s parameters, gradients and optimizer state (local shards)."""
    import torch

    from hf_omni.shards.box import local_of as local

    params = list(module.parameters())
    total = sum(local(p).numel() * local(p).element_size() for p in params)
    total += sum(local(p.grad).numel() * local(p.grad).element_size() for p in params if p.grad is not None)
    for p in params:
        for value in optimizer.state.get(p, {}).values():
            if torch.is_tensor(value) and value.numel() > 1:
                total += local(value).numel() * local(value).element_size()
    return total


def memory_worker(variant: str):
    import torch
    import torch.distributed as dist
    from transformers import Trainer, TrainingArguments

    from hf_omni import OmniTrainer, OmniTrainingArguments
    from hf_omni.testing.digits import Captioner, build_tokenizer, load_splits

    train_set, _ = load_splits(build_tokenizer())
    common = dict(max_steps=3, per_device_train_batch_size=4, learning_rate=1e-4, optim="adamw_torch",
                  use_cpu=True, report_to="none", save_strategy="no", disable_tqdm=True, logging_steps=10_000)
    held = {}
    if variant.startswith("masters_"):  # the bf16 LLM under `bf16: true`: fp32 masters or pure bf16
        from transformers import TrainerCallback

        class Held(TrainerCallback):  # gradients and (from step 2) optimizer state present
            def on_pre_optimizer_step(self, args, state, control, **kwargs):
                held["bytes"] = held_bytes(model.llm, trainer.optimizer.optimizers["llm"])

        model = Captioner.from_pretrained(BIG_BF16_DIR, empty_init=True)
        master = {"masters_fp32": "float32", "masters_bf16": "bfloat16"}[variant]
        modules = {**MODULES, "llm": {**MODULES["llm"], "master_dtype": master}}
        args = OmniTrainingArguments(output_dir=f"/tmp/hf_omni_bench/mem_{variant}", modules=modules, bf16=True,
                                     **common)
        trainer = OmniTrainer(model=model, args=args, train_dataset=train_set, callbacks=[Held()])
    elif variant == "omni":
        model = Captioner.from_pretrained(BIG_DIR, empty_init=True)
        args = OmniTrainingArguments(output_dir="/tmp/hf_omni_bench/mem_omni", modules=MODULES, **common)
        trainer = OmniTrainer(model=model, args=args, train_dataset=train_set)
    else:
        model = Captioner.from_pretrained(BIG_DIR)
        model.vision.requires_grad_(False)
        args = TrainingArguments(output_dir="/tmp/hf_omni_bench/mem_trainer", **common)
        trainer = Trainer(model=model, args=args, train_dataset=train_set)
    llm_params = sum(p.numel() for p in model.llm.parameters())
    trainer.train()
    peak = torch.tensor([resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20], dtype=torch.float64)
    peaks = [torch.zeros_like(peak) for _ in range(dist.get_world_size())]
    dist.all_gather(peaks, peak)
    if dist.get_rank() == 0:
        print(f"MEM {variant} llm_params={llm_params} peak_gb={max(p.item() for p in peaks):.3f} "
              f"held={held.get('bytes', 0)}")


def parse(output: str, tag: str) -> dict[str, str]:
    line = next(line for line in output.splitlines() if line.startswith(tag))
    return dict(item.split("=") for item in line.split()[1:] if "=" in item)


def main():
    only = sys.argv[sys.argv.index("--only") + 1] if "--only" in sys.argv else None
    if only in (None, "step"):
        step_time()
    if only in (None, "memory"):
        memory()


def step_time():
    step = parse(launch("--step-time"), "STEP")
    omni, by_hand = float(step["omni"]), float(step["by_hand"])
    print(f"bench/fsdp.py, 2 gloo ranks on CPU\n\nStep time, demo model (LLM sharded, batch {BATCH}/rank, "
          f"median of {ROUNDS} rounds x {MEASURED} steps):\n")
    print("| variant | median step (ms) |\n|---|---|")
    print(f"| OmniTrainer | {omni:.1f} |\n| hand-written per-module fully_shard loop | {by_hand:.1f} |")
    print(f"\nOmniTrainer / hand-written loop: {omni / by_hand:.3f} (goal <= 1.03)\n")


def memory():
    subprocess.run([sys.executable, __file__, "--save-big"], check=True, capture_output=True)
    rows = []
    for allocator, env in (("glibc default", {}), ("MALLOC_MMAP_THRESHOLD_=131072",
                                                   {"MALLOC_MMAP_THRESHOLD_": "131072"})):
        got = {v: parse(launch("--memory", v, env=env), "MEM") for v in ("omni", "trainer")}
        rows.append((allocator, float(got["omni"]["peak_gb"]), float(got["trainer"]["peak_gb"]),
                     int(got["omni"]["llm_params"])))
    print(f"Peak RSS per rank (max over ranks), LLM of {rows[0][3] / 1e6:.0f}M parameters trained in full, "
          "3 steps:\n")
    print("| allocator | OmniTrainer, FSDP LLM, empty_init (GB) | Trainer + DDP (GB) | ratio (goal <= 0.60) |")
    print("|---|---|---|---|")
    for allocator, omni_gb, trainer_gb, _ in rows:
        print(f"| {allocator} | {omni_gb:.2f} | {trainer_gb:.2f} | {omni_gb / trainer_gb:.3f} |")

    env = {"MALLOC_MMAP_THRESHOLD_": "131072"}
    got = {v: parse(launch("--memory", v, env=env), "MEM") for v in ("masters_fp32", "masters_bf16")}
    n = int(got["masters_fp32"]["llm_params"])
    print("\nThe price of fp32 master weights: the same LLM saved in bf16, sharded over 2 ranks, `empty_init`, "
          "`bf16: true`, MALLOC_MMAP_THRESHOLD_=131072; held = the LLM's parameters + gradients + AdamW state on "
          "one rank at step 3:\n")
    print("| master_dtype | held per rank (MB) | bytes per parameter (x ranks) | peak RSS per rank (GB) |")
    print("|---|---|---|---|")
    for variant, name in (("masters_fp32", "auto (fp32 masters)"), ("masters_bf16", "bfloat16 (pure bf16)")):
        held = int(got[variant]["held"])
        print(f"| {name} | {held / 2**20:.1f} | {held * 2 / n:.2f} | {float(got[variant]['peak_gb']):.2f} |")
    ratio = int(got["masters_fp32"]["held"]) / int(got["masters_bf16"]["held"])
    print(f"\nfp32 masters / pure bf16, held bytes: {ratio:.3f} (theory 16 / 8 bytes per parameter = 2.000)")


if __name__ == "__main__":
    if "--step-time" in sys.argv:
        step_time_worker()
        end_distributed()  # groups destroyed, results flushed, then os._exit: see tests/launching.py
    elif "--memory" in sys.argv:
        memory_worker(sys.argv[sys.argv.index("--memory") + 1])
        end_distributed()
    elif "--save-big" in sys.argv:
        save_big_model()
    else:
        main()
