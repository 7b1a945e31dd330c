"""Run under `accelerate launch --multi_gpu --num_processes 2` (gloo, use_cpu): the toy layout (the LLM at
`parallelism: {toy_size: 2}`) and the toy composition (a recipe beside the modules) of tests/toy_kinds.py, each
trained, checkpointed, resumed and exported at 2 ranks.

Usage: mp_toy_kinds.py OUT_DIR. Rank 0 writes OUT_DIR/<kind>.pt; tests/test_toy_kinds.py compares them with the
runs at 1 process."""

import os
import sys

import torch
import torch.distributed as dist
from launching import end_distributed
from toy_kinds import LAYOUT, RECIPE, layout_model, recipe_model, run


def main(out_dir: str):
    for name, build, modules in (("layout", layout_model, LAYOUT), ("recipe", recipe_model, RECIPE)):
        result = run(os.path.join(out_dir, name), build, modules, batch=4)
        if dist.get_rank() == 0:
            torch.save(result, os.path.join(out_dir, f"{name}.pt"))
        dist.barrier()


if __name__ == "__main__":
    main(sys.argv[1])
    end_distributed()
