"""Run under `accelerate launch --multi_gpu --num_processes 4` (gloo, use_cpu): every mesh scenario in one launch.

Usage: mp_mesh.py OUT_DIR. Rank 0 writes OUT_DIR/<scenario>.pt: step losses, final full weights, and facts about
the meshes (each module's mesh shape, one parameter's placements, bytes held by this rank).
       mp_mesh.py OUT_DIR elastic CHECKPOINT (any world size): resumes CHECKPOINT with mesh_scenarios.ELASTIC into
OUT_DIR/elastic, writing OUT_DIR/elastic.pt."""

import os
import sys

import helpers
import torch
import torch.distributed as dist
from transformers import TrainerCallback
from helpers import full_state
from mesh_scenarios import ELASTIC, SCENARIOS, build
from held_gradients import sample_after_backward
from mp_scenarios import sharding_facts

from hf_omni import OmniTrainer
from hf_omni.compat import group_timeout
from hf_omni.core.dist import checkpoint_group
from hf_omni.testing.collectives import ReceivedBytes
from launching import end_distributed


def elastic(out_dir: str, checkpoint: str):
    model = helpers.tiny_model()
    args = helpers.make_args(os.path.join(out_dir, "elastic"), **ELASTIC)
    trainer = OmniTrainer(model=model, args=args, train_dataset=helpers.tiny_data(model))
    trainer.train(resume_from_checkpoint=checkpoint)
    state = full_state(model)
    if dist.get_rank() == 0:
        torch.save({"losses": helpers.step_losses(trainer), "state": state, "world_size": dist.get_world_size(),
                    "mesh_shapes": {n: tuple(m.shape) for n, m in trainer.plugin.meshes.items()}},
                   os.path.join(out_dir, "elastic.pt"))


def group_timeouts(meshes) -> dict:
    """Seconds of timeout of every group this rank is in: the default one, hf_omni's side groups, each mesh's."""
    seconds = {"world": group_timeout(dist.group.WORLD, "cpu"), "side": group_timeout(checkpoint_group(), "cpu")}
    for name, mesh in meshes.items():
        for dim in mesh.mesh_dim_names:
            seconds[f"{name}.{dim}"] = group_timeout(mesh.get_group(dim), "cpu")
    return {key: value.total_seconds() for key, value in seconds.items()}


class SideCollectives(TrainerCallback):
    """Per optimizer step, the collectives `side` counted since the previous step ended (the step's window agreed in
    `get_batch_samples` before its first micro-step, its forwards, its clipping)."""

    def __init__(self, side: ReceivedBytes):
        self.side, self.seen, self.steps = side, {}, []

    def on_train_begin(self, args, state, control, **kwargs):  # after the offline caches' encoding
        self.seen = dict(self.side.calls)

    def on_step_end(self, args, state, control, **kwargs):
        self.steps.append({k: v - self.seen.get(k, 0) for k, v in self.side.calls.items() if v > self.seen.get(k, 0)})
        self.seen = dict(self.side.calls)


def main(out_dir: str):
    os.environ["HF_OMNI_TEST_SAVED"] = os.path.join(out_dir, "saved")  # empty_init_model: one folder for all ranks
    for name, spec in SCENARIOS.items():
        model, data, collator = build(spec)
        args = helpers.make_args(os.path.join(out_dir, name), **spec["multi"])
        trainer = OmniTrainer(model=model, args=args, train_dataset=data, data_collator=collator)
        held = sample_after_backward(trainer, model.omni_modules())
        side = ReceivedBytes(group=checkpoint_group(args.ddp_timeout))  # hf_omni's side group: its collectives
        trainer.add_callback(per_step := SideCollectives(side))
        with side:
            trainer.train()
        meshes = trainer.plugin.meshes
        facts = {
            "world_size": dist.get_world_size(),
            "wrapped": dict(trainer.plugin.wrapped),
            "mesh_shapes": {n: tuple(m.shape) for n, m in meshes.items()},
            "shared": {a: [b for b in meshes if meshes[b] is meshes[a]] for a in meshes},
            "groups": {n: {dim: dist.get_process_group_ranks(m.get_group(dim)) for dim in m.mesh_dim_names}
                       for n, m in meshes.items()},  # rank 0's group along each mesh dim
            "placements": {n: str(next(getattr(model, n, model).parameters()).placements) for n in meshes},
            "sharding": sharding_facts(model),
            "held_gradients": held,  # bytes after each micro-step's backward, per module
            "timeouts": group_timeouts(meshes),
            "side_collectives": per_step.steps,  # per optimizer step: {name: calls} on the side group
        }
        state = full_state(model)
        if dist.get_rank() == 0:
            torch.save({"losses": helpers.step_losses(trainer), "state": state, "facts": facts},
                       os.path.join(out_dir, f"{name}.pt"))
        dist.barrier()


if __name__ == "__main__":
    elastic(sys.argv[1], sys.argv[3]) if sys.argv[2:3] == ["elastic"] else main(sys.argv[1])
    end_distributed()
