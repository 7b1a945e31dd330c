"""2 gloo ranks: straight 10 steps vs 5 + resume 5 (same world size), for replicated and sharded LLMs, and a
resume of a 1-rank checkpoint (1 -> 2); every resume with unpickling refused (tests/no_pickle.py). Rank 0 writes OUT_DIR/resume_<layout>.pt.

Usage: mp_resume.py OUT_DIR [ONE_RANK_CHECKPOINT_DIR]"""

import os
import sys

import torch
import torch.distributed as dist
from checkpoint_scenario import LAYOUTS, resume_trainer
from helpers import full_state, step_losses
from no_pickle import no_unpickling
from transformers import TrainerCallback
from launching import end_distributed


class StopAt(TrainerCallback):
    def __init__(self, step):
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            control.should_training_stop = True


def main(out_dir, one_rank_dir=None):
    results = {}
    for layout in LAYOUTS:
        straight = resume_trainer(os.path.join(out_dir, layout, "straight"), layout, per_device=4)
        straight.train()
        first = resume_trainer(os.path.join(out_dir, layout, "split"), layout, per_device=4, callbacks=[StopAt(5)])
        first.train()
        second = resume_trainer(os.path.join(out_dir, layout, "split"), layout, per_device=4, seed=5)
        with no_unpickling():  # resume reads safetensors and JSON only, at every rank
            second.train(resume_from_checkpoint=True)
        results[layout] = {"straight": (step_losses(straight), full_state(straight.model)),
                           "resumed": (step_losses(second), full_state(second.model))}
        if one_rank_dir:  # 1 -> 2: the 1-rank run's step-5 checkpoint, the same global batch
            grown = resume_trainer(os.path.join(one_rank_dir, layout), layout, per_device=4, seed=5)
            with no_unpickling():
                grown.train(resume_from_checkpoint=True)
            results[layout]["grown"] = (step_losses(grown), full_state(grown.model))
    if dist.get_rank() == 0:
        torch.save(results, os.path.join(out_dir, "resume.pt"))
    dist.barrier()


if __name__ == "__main__":
    main(*sys.argv[1:])
    end_distributed()
