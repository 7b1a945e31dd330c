"""Run under `accelerate launch --multi_gpu --num_processes 2` (gloo, use_cpu): each released MoE family of
tests/adopted_experts.py adopted with `from_model`, its experts spread over 2 ranks (`ep_size: 2`), trained,
checkpointed, resumed and exported.

Usage: mp_adopted_experts.py OUT_DIR. Rank 0 writes OUT_DIR/<family>.pt; tests/test_adopted_experts.py compares
them with one process."""

import os
import sys

import torch
import torch.distributed as dist
from adopted_experts import EP, FAMILIES, run
from launching import end_distributed


def main(out_dir: str):
    for family in FAMILIES:
        result = run(os.path.join(out_dir, family), family, EP, batch=4)
        if dist.get_rank() == 0:
            torch.save(result, os.path.join(out_dir, f"{family}.pt"))
        dist.barrier()


if __name__ == "__main__":
    main(sys.argv[1])
    end_distributed()
