"""Runs shared by the 2-rank and 1-rank resume tests: 10 steps, a checkpoint every 5, global batch 8."""

from checkpoint_scenario import MODULES
from helpers import make_args, tiny_data, tiny_model

from hf_omni import OmniTrainer

LAYOUTS = {
    "replicated": MODULES,
    "sharded": {**MODULES, "llm": {**MODULES["llm"], "parallel": "fsdp"}},
    # async saves overlapping training: an FSDP llm beside a DDP projector, one background writer
    "sharded_async": {**MODULES, "llm": {**MODULES["llm"], "parallel": "fsdp"}},
}


def make_trainer(out_dir, layout, per_device, seed=0, callbacks=()):
    model = tiny_model(seed=seed)
    args = make_args(out_dir, max_steps=10, save_strategy="steps", save_steps=5,
                     modules=LAYOUTS[layout], train_sampling_strategy="random", per_device_train_batch_size=per_device,
                     save_async=layout.endswith("_async"))
    return OmniTrainer(model=model, args=args, train_dataset=tiny_data(model, 48), callbacks=list(callbacks))
