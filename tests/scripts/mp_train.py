"""Run under `accelerate launch --multi_gpu --num_processes 2` (gloo, use_cpu): many scenarios per launch.

Usage: mp_train.py OUT_DIR. Rank 0 writes OUT_DIR/<scenario>.pt with the step losses, the final full weights and
facts about the wrapping; the test compares them with single-process runs of the same scenarios.
"""

import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from helpers import make_args, step_losses, tiny_data, tiny_model  # noqa: E402
from mp_scenarios import SCENARIOS, full_state_dict  # noqa: E402

from hf_omni import OmniTrainer  # noqa: E402


def main(out_dir: str, names: list[str]):
    for name in names:
        spec = SCENARIOS[name]
        model = tiny_model()
        data = tiny_data(model)
        args = make_args(os.path.join(out_dir, name), **spec["multi"])
        trainer = OmniTrainer(model=model, args=args, train_dataset=data)
        # the composed forward calls model.llm.get_input_embeddings() outside the llm's own forward
        trainer.train()
        facts = {
            "wrapped": dict(trainer.plugin.wrapped),
            "classes": {n: type(m).__name__ for n, m in model.omni_modules().items()},
            "llm_isinstance": isinstance(model.llm, type(tiny_model().llm)),
            "fsdp_plugins": sorted(trainer.plugin.fsdp_plugins),
            "world_size": dist.get_world_size(),
        }
        state = full_state_dict(model)
        trainer.save_model(os.path.join(out_dir, name, "export"))
        if dist.get_rank() == 0:
            torch.save({"losses": step_losses(trainer), "state": state, "facts": facts},
                       os.path.join(out_dir, f"{name}.pt"))
        dist.barrier()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:] or list(SCENARIOS))
