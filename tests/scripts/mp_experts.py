"""Fused MoE experts sharded on their dim 1 (forced: tests/moe_runs.py `experts_on_dim1`) at 2 gloo ranks, one
launch: an `empty_init` Mixtral read from its folder (each rank its box of every expert's file tensors), trained 4
steps with a checkpoint at step 2, exported; then resumed from checkpoint-2 into a model with other weights. Rank 0
writes every rank's results to OUT_DIR/experts.pt.

Usage: mp_experts.py OUT_DIR"""

import os
import sys

import torch.distributed as dist
from helpers import full_state, save_every_rank, step_losses
from launching import end_distributed
from moe_runs import experts_on_dim1, saved_folder, trainer


def main(out: str) -> None:
    from accelerate import PartialState

    PartialState()  # the process group (gloo)
    experts_on_dim1()
    if dist.get_rank() == 0:
        saved_folder(out)
    dist.barrier()
    straight = trainer(out, os.path.join(out, "straight"), batch=2)
    straight.train()
    placements = {n: str(p.placements) for n, p in straight.model.llm.named_parameters()}
    straight.save_model(os.path.join(out, "export"))
    resumed = trainer(out, os.path.join(out, "resumed"), batch=2, empty_init=False, seed=7)
    resumed.train(resume_from_checkpoint=os.path.join(out, "straight", "checkpoint-2"))
    save_every_rank(dict(world_size=dist.get_world_size(), placements=placements, losses=step_losses(straight),
                         state=full_state(straight.model), resumed_losses=step_losses(resumed),
                         resumed=full_state(resumed.model)), os.path.join(out, "experts.pt"))


if __name__ == "__main__":
    main(sys.argv[1])
    end_distributed()
