"""HSDP with tensor or expert parallelism needs 8 ranks (dp_replicate 2 x dp_shard 2 x tp 2; dp_replicate 2 x
dp_shard 4 x ep 2), more than CI launches: run by hand, about 2 minutes on 2 cores.

    python tests/scripts/mp_layouts_8.py          # one 8-rank launch for both, then one process each; prints diffs

Each layout trains the captioner (its Llama split by tp, or a Qwen2-MoE LLM with its experts spread) for 3 steps on
16 rows a step (2 per rank), saving a checkpoint at step 2; one process runs the same global batch. Prints the
largest loss and weight differences and the llm's placements, and exits non-zero above 1e-5.
"""

import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

LAYOUTS = {"hsdp_tp": {"dp_replicate_size": 2, "dp_shard_size": 2, "tp_size": 2},
           "hsdp_ep": {"dp_replicate_size": 2, "dp_shard_size": 4, "ep_size": 2}}


def run(out_dir: str, name: str, world: int) -> dict:
    import helpers
    import torch.distributed as dist
    import tp_scenarios

    from hf_omni import OmniTrainer

    model = tp_scenarios.tp_model(moe=name.endswith("ep"))
    modules = tp_scenarios.llm(LAYOUTS[name] if world > 1 else None, max_grad_norm=0.5)
    if world == 1:
        modules["llm"].pop("parallelism")
    args = helpers.make_args(os.path.join(out_dir, f"{name}_{world}"), modules=modules, max_steps=3,
                             per_device_train_batch_size=16 // world, save_strategy="steps", save_steps=2)
    trainer = OmniTrainer(model=model, args=args, train_dataset=helpers.tiny_data(model))
    trainer.train()
    state = helpers.full_state(model)
    placements = {k: str(p.placements) for k, p in model.llm.named_parameters() if hasattr(p, "placements")}
    return {"losses": helpers.step_losses(trainer), "state": state, "placements": placements,
            "rank": dist.get_rank() if world > 1 else 0}


def worker(out_dir: str):
    import torch
    from launching import end_distributed

    for name in LAYOUTS:
        got = run(out_dir, name, int(os.environ["WORLD_SIZE"]))
        if got["rank"] == 0:
            torch.save(got, os.path.join(out_dir, f"{name}.pt"))
    end_distributed()


def main():
    import tempfile

    import torch
    from launching import launch

    out = tempfile.mkdtemp(prefix="layouts8_")
    launch("mp_layouts_8.py", "--worker", out, processes=8, timeout=900, env_extra={"OMP_NUM_THREADS": "1"})
    worst = 0.0
    for name in LAYOUTS:
        got, single = torch.load(os.path.join(out, f"{name}.pt"), weights_only=True), run(out, name, 1)
        losses = max(abs(a - b) for a, b in zip(got["losses"], single["losses"]))
        weights = max((got["state"][k] - v).abs().max().item() for k, v in single["state"].items())
        worst = max(worst, losses, weights)
        shown = {k: v for k, v in got["placements"].items() if "layers.0" in k and ("q_proj" in k or "experts" in k)}
        print(f"{name} {LAYOUTS[name]}: losses {losses:.2e}, weights {weights:.2e}; {shown}")
    sys.exit(0 if worst <= 1e-5 else 1)


if __name__ == "__main__":
    if "--worker" in sys.argv:
        worker(sys.argv[sys.argv.index("--worker") + 1])
    else:
        main()
