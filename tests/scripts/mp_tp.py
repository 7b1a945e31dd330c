"""Run under `accelerate launch --multi_gpu --num_processes N` (gloo, use_cpu): every tests/tp_scenarios.py scenario
for N ranks, in one launch. Usage: mp_tp.py OUT_DIR. Rank 0 writes OUT_DIR/<scenario>.pt: step losses, final full
weights, and the llm's parameter placements."""

import os
import sys

import helpers
import torch
import torch.distributed as dist
import tp_scenarios

from hf_omni import OmniTrainer
from launching import end_distributed


def main(out_dir: str):
    for name, (processes, _, _) in tp_scenarios.SCENARIOS.items():
        if processes != int(os.environ["WORLD_SIZE"]):
            continue
        model = tp_scenarios.tp_model()
        trainer = OmniTrainer(model=model, args=tp_scenarios.args(os.path.join(out_dir, name), name),
                              train_dataset=helpers.tiny_data(model))
        trainer.train()
        placements = {key: str(p.placements) for key, p in model.llm.named_parameters()}
        state = helpers.full_state(model)
        if dist.get_rank() == 0:
            torch.save({"losses": helpers.step_losses(trainer), "state": state, "placements": placements},
                       os.path.join(out_dir, f"{name}.pt"))


if __name__ == "__main__":
    main(sys.argv[1])
    end_distributed()
