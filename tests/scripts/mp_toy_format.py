"""Run under `accelerate launch --multi_gpu --num_processes 2` (gloo, use_cpu): the toy-format composition
(tests/toy_runs.py) trained, checkpointed, resumed, exported and rebuilt at 2 ranks, the toy module under FSDP
("fsdp", the LLM under DDP) and under DDP ("ddp", the LLM under FSDP).

Usage: mp_toy_format.py OUT_DIR. Rank 0 writes OUT_DIR/<scenario>.pt; tests/test_toy_format.py compares them with
the run at 1 process.
"""

import os
import sys

import torch
import torch.distributed as dist
from toy_runs import MODULES, run

from launching import end_distributed

SCENARIOS = {"fsdp": {"toy": {**MODULES["toy"], "parallel": "fsdp"}, "llm": MODULES["llm"]},
             "ddp": {"toy": MODULES["toy"], "llm": {**MODULES["llm"], "parallel": "fsdp"}}}


def main(out_dir: str):
    for name, modules in SCENARIOS.items():
        result = run(os.path.join(out_dir, name), modules, batch=4)
        if dist.get_rank() == 0:
            torch.save(result, os.path.join(out_dir, f"{name}.pt"))
        dist.barrier()


if __name__ == "__main__":
    main(sys.argv[1])
    end_distributed()
