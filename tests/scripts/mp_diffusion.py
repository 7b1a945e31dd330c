"""Run under `accelerate launch --multi_gpu --num_processes 2` (gloo, use_cpu): the tiny diffusion pipelines
(tests/diffusion_runs.py) trained at 2 ranks (batch 2 each): SD with its UNet sharded and its text encoder
replicated (trained, checkpointed, resumed, exported), Flux with its transformer sharded (trained, exported), and
Flux with LoRA on the sharded transformer and the replicated CLIP encoder (resumed; exported: merged components and
diffusers' LoRA file, the adapters gathered from both ranks).

Usage: mp_diffusion.py OUT_DIR. Rank 0 writes OUT_DIR/<scenario>.pt; tests/test_diffusion.py compares them with
the hand-written loop at 1 process and loads the exports with diffusers alone.
"""

import os
import sys

import torch
import torch.distributed as dist
from diffusion_runs import FLUX, FLUX_LORA, SD, run

from launching import end_distributed

SCENARIOS = {"sd": ("sd", SD, True), "flux": ("flux", FLUX, False), "flux_lora": ("flux", FLUX_LORA, True)}


def main(out_dir: str):
    for name, (kind, modules, resume) in SCENARIOS.items():
        result = run(kind, os.path.join(out_dir, name), modules, batch=2, resume=resume)
        if dist.get_rank() == 0:
            torch.save(result, os.path.join(out_dir, f"{name}.pt"))
        dist.barrier()


if __name__ == "__main__":
    main(sys.argv[1])
    end_distributed()
