"""Run under `accelerate launch --multi_gpu --num_processes 8` (gloo, use_cpu): HSDP with tensor or expert
parallelism, which needs 8 ranks (tests/test_layouts_8.py). Usage: mp_layouts_8.py OUT_DIR.

Each of `LAYOUTS` trains the captioner (its Llama split by tp, or a Qwen2-MoE LLM with its experts spread) for 3 steps
on 16 rows a step (2 per rank, each rank its own), saving a checkpoint at step 2, then a model built from another seed
resumes from that checkpoint at the same layout. Rank 0 writes OUT_DIR/<layout>.pt: step losses, final full weights,
the llm's placements, the resumed run's losses and final weights.
"""

import os
import sys

import helpers
import torch
import torch.distributed as dist
import tp_scenarios

from hf_omni import OmniTrainer
from launching import end_distributed

HSDP_TP = {"dp_replicate_size": 2, "dp_shard_size": 2, "tp_size": 2}
LAYOUTS = {  # name: (the llm's entry, whether its LLM is the Qwen2-MoE)
    "hsdp_tp": (tp_scenarios.llm(HSDP_TP, max_grad_norm=0.5), False),
    "hsdp_tp_lora": (tp_scenarios.llm(HSDP_TP, lora=tp_scenarios.LORA, learning_rate=3e-3), False),
    "hsdp_sp": (tp_scenarios.llm({"dp_replicate_size": 2, "dp_shard_size": 2, "sp_size": 2}, max_grad_norm=0.5),
                False),
    "hsdp_ep": (tp_scenarios.llm({"dp_replicate_size": 2, "dp_shard_size": 4, "ep_size": 2}, max_grad_norm=0.5), True),
}


def model(name: str, seed: int = 0):
    return tp_scenarios.tp_model(seed, moe=LAYOUTS[name][1])


def args(out_dir: str, name: str, world: int, **extra):
    """The layout's arguments at `world` ranks (1: no parallelism entry), 16 rows a step in all."""
    modules = {k: dict(v) for k, v in LAYOUTS[name][0].items()}
    if world == 1:
        modules["llm"].pop("parallelism")
    return helpers.make_args(out_dir, modules=modules, max_steps=3, per_device_train_batch_size=16 // world, **extra)


def main(out_dir: str):
    for name in LAYOUTS:
        trained = model(name)
        trainer = OmniTrainer(model=trained, args=args(os.path.join(out_dir, name), name, 8, save_strategy="steps",
                                                       save_steps=2), train_dataset=helpers.tiny_data(trained))
        trainer.train()
        state = helpers.full_state(trained)
        placements = {k: str(p.placements) for k, p in trained.llm.named_parameters() if hasattr(p, "placements")}
        resumed = model(name, seed=7)
        again = OmniTrainer(model=resumed, args=args(os.path.join(out_dir, name + "_resumed"), name, 8),
                            train_dataset=helpers.tiny_data(resumed))
        again.train(resume_from_checkpoint=os.path.join(out_dir, name, "checkpoint-2"))
        resumed_state = helpers.full_state(resumed)
        if dist.get_rank() == 0:
            torch.save({"losses": helpers.step_losses(trainer), "state": state, "placements": placements,
                        "resumed_losses": helpers.step_losses(again), "resumed": resumed_state},
                       os.path.join(out_dir, f"{name}.pt"))


if __name__ == "__main__":
    main(sys.argv[1])
    end_distributed()
