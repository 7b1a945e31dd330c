"""CUDA / NCCL check of per-module FSDP2 with bf16 mixed precision, and of Trainer's fp16 with one GradScaler
shared by every module's optimizer (run it whenever a GPU is at hand).

    torchrun --nproc_per_node 1 bench/gpu_check.py          # a process group of world size 1: modules get wrapped

The demo model trains a few steps with the LLM sharded by its own FSDP2 plugin (bf16 parameters, fp32
reductions), the projector replicated and the vision encoder frozen; the same model and data run through a plain
fp32 PyTorch loop on the CPU. Losses must agree within bf16 tolerance. Without CUDA it runs the same on CPU/gloo
(say so in your note: that is not the CUDA check), and skips the fp16 run (fp16 is refused on CPU). Exit status 1
when the losses disagree.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import sys
import time

import torch

from hf_omni import OmniTrainer, OmniTrainingArguments
from hf_omni.testing.digits import build_model, load_splits

STEPS, BATCH, TOLERANCE = 12, 32, 0.03
MODULES = {
    "vision": {"trainable": False},
    "projector": {"learning_rate": 3e-3},
    "llm": {"parallel": "fsdp", "learning_rate": 1e-3,
            "fsdp_plugin": {"mixed_precision": {"param_dtype": "bfloat16", "reduce_dtype": "float32"}}},
}


def reference_losses(model, dataset) -> list[float]:
    """fp32 on the CPU: AdamW per trainable module, the same constant learning rates, clipping at 1.0."""
    model = model.cpu().float()
    model.vision.requires_grad_(False)
    model.vision.eval()
    optimizers = {n: torch.optim.AdamW(getattr(model, n).parameters(), lr=MODULES[n]["learning_rate"])
                  for n in ("projector", "llm")}
    losses = []
    for step in range(STEPS):
        items = [dataset[i] for i in range(step * BATCH, (step + 1) * BATCH)]
        batch = {k: torch.stack([it[k] for it in items]) for k in items[0]}
        loss = model(**batch).loss
        loss.backward()
        for name, opt in optimizers.items():
            torch.nn.utils.clip_grad_norm_(getattr(model, name).parameters(), 1.0)
            opt.step()
            opt.zero_grad()
        losses.append(loss.item())
    return losses


def train(model, train_set, cuda: bool, modules: dict, **extra):
    settings = dict(output_dir="/tmp/hf_omni_gpu_check", save_strategy="no")
    settings.update(extra)
    args = OmniTrainingArguments(
        max_steps=STEPS, per_device_train_batch_size=BATCH, logging_steps=1, lr_scheduler_type="constant",
        optim="adamw_torch", train_sampling_strategy="sequential", use_cpu=not cuda, report_to="none",
        disable_tqdm=True, modules=modules, **settings)
    trainer = OmniTrainer(model=model, args=args, train_dataset=train_set)
    start = time.perf_counter()
    trainer.train()
    return trainer, [e["loss"] for e in trainer.state.log_history if "loss" in e], time.perf_counter() - start


def report(title: str, losses: list[float], reference: list[float]) -> bool:
    print(f"| step | loss ({title}) | loss (CPU fp32 loop) | rel. diff |")
    print("|---|---|---|---|")
    worst = 0.0
    for step, (got, ref) in enumerate(zip(losses, reference), 1):
        rel = abs(got - ref) / abs(ref)
        worst = max(worst, rel)
        print(f"| {step} | {got:.4f} | {ref:.4f} | {rel:.4f} |")
    ok = worst <= TOLERANCE and len(losses) == STEPS
    print(f"{'PASS' if ok else 'FAIL'} {title}: max relative difference {worst:.4f} (tolerance {TOLERANCE})\n")
    return ok


def main():
    cuda = torch.cuda.is_available()
    model = build_model()
    train_set, _ = load_splits(model.processors["llm"])
    reference = reference_losses(copy.deepcopy(model), train_set)
    fp16_model = copy.deepcopy(model)
    # async checkpoints under the training backend (NCCL on CUDA): their DCP traffic runs on hf_omni's gloo groups
    run_dir = "/tmp/hf_omni_gpu_check/async"
    if os.environ.get("RANK", "0") == "0":  # other ranks write nothing before the first save
        shutil.rmtree(run_dir, ignore_errors=True)
    trainer, losses, seconds = train(model, train_set, cuda, MODULES, output_dir=run_dir, save_strategy="steps",
                                     save_steps=STEPS // 2, save_async=True)
    from hf_omni.checkpoint.files import complete_checkpoints

    async_saves = [os.path.basename(p) for p in complete_checkpoints(run_dir)]
    fp16 = None
    if cuda:  # every rank trains it; the LLM replicated here: the check is the scaler shared by the optimizers
        fp16_modules = {n: {**{k: v for k, v in m.items() if k != "fsdp_plugin"}, "parallel": "ddp"}
                        for n, m in MODULES.items()}
        fp16 = train(fp16_model, train_set, cuda, fp16_modules, fp16=True, output_dir="/tmp/hf_omni_gpu_check/fp16",
                     save_strategy="steps", save_steps=STEPS)
    if not trainer.is_world_process_zero():
        return
    backend = torch.distributed.get_backend() if torch.distributed.is_initialized() else "none"
    device = torch.cuda.get_device_name() if cuda else "cpu (NOT the CUDA check; fp16 skipped)"
    print(f"\nbench/gpu_check.py: {device}, backend {backend}, wrapped {trainer.plugin.wrapped}, "
          f"llm param dtype in forward: bf16, {STEPS} steps in {seconds:.1f} s")
    ok = report("FSDP2, bf16", losses, reference)
    print(f"async saves under {backend}, marked complete: {async_saves}")
    ok = ok and async_saves == [f"checkpoint-{STEPS // 2}", f"checkpoint-{STEPS}"]
    if fp16 is not None:
        scaler = fp16[0].plugin.scaler
        print(f"fp16: one GradScaler shared by {sorted(fp16[0].plugin.optimizer.optimizers)}: {scaler is not None}, "
              f"final scale {scaler.get_scale() if scaler else None}")
        ok = report("Trainer fp16, shared GradScaler", fp16[1], reference) and scaler is not None and ok
        with open(f"/tmp/hf_omni_gpu_check/fp16/checkpoint-{STEPS}/scaler.json") as f:  # resumes with its scale
            saved_scale = json.load(f)["scale"]
        print(f"fp16 checkpoint: scaler.json scale {saved_scale}")
        ok = ok and saved_scale == scaler.get_scale()
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
