"""Run under `accelerate launch --multi_gpu --num_processes 2` (gloo, use_cpu): per-module EMA (tests/ema_runs.py)
with the toy module under FSDP (its shadows DTensors sharded like its parameters) and the LLM under DDP: trained,
checkpointed at step 2, exported with `export_ema`, resumed.

Usage: mp_ema.py OUT_DIR. Rank 0 writes OUT_DIR/result.pt (and the shadows' placements); tests/test_ema.py compares
it with the run at 1 process and resumes OUT_DIR/checkpoint-2 at 1 process.
"""

import os
import sys

import torch
import torch.distributed as dist
from ema_runs import MODULES, run

from launching import end_distributed


def main(out_dir: str):
    modules = {"toy": {**MODULES["toy"], "parallel": "fsdp"}, "llm": MODULES["llm"]}
    result = run(out_dir, modules, batch=2)
    if dist.get_rank() == 0:
        torch.save(result, os.path.join(out_dir, "result.pt"))
    dist.barrier()


if __name__ == "__main__":
    main(sys.argv[1])
    end_distributed()
