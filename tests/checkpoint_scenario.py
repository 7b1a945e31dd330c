"""The runs the checkpoint tests share: `make_trainer` (kill points, failures: 15 steps, a checkpoint every 5, keep 1,
accumulation 2) and `resume_trainer` (resume at 1 and 2 ranks: 10 steps, a checkpoint every 5, global batch 8, in the
module layouts of `LAYOUTS`)."""

from helpers import make_args, tiny_data, tiny_model

from hf_omni import OmniTrainer

MODULES = {
    "vision": {"trainable": False},
    "projector": {"learning_rate": 3e-3, "lr_scheduler_type": "cosine", "max_grad_norm": 0.05},
    "llm": {"learning_rate": 1e-3, "lora": {"r": 4, "target_modules": ["q_proj", "v_proj"]}, "warmup_steps": 2},
}


def make_trainer(out_dir, seed=0, callbacks=(), **overrides):
    model = tiny_model(seed=seed)
    args = dict(max_steps=15, save_strategy="steps", save_steps=5, save_total_limit=1, modules=MODULES,
                train_sampling_strategy="random", per_device_train_batch_size=4, gradient_accumulation_steps=2)
    args.update(overrides)
    return OmniTrainer(model=model, args=make_args(out_dir, **args), train_dataset=tiny_data(model, 48),
                       callbacks=list(callbacks))


LAYOUTS = {
    "replicated": MODULES,
    "sharded": {**MODULES, "llm": {**MODULES["llm"], "parallel": "fsdp"}},
    # async saves overlapping training: an FSDP llm beside a DDP projector, one background writer
    "sharded_async": {**MODULES, "llm": {**MODULES["llm"], "parallel": "fsdp"}},
}


def resume_trainer(out_dir, layout, per_device, seed=0, callbacks=()):
    return make_trainer(out_dir, seed, callbacks, max_steps=10, save_total_limit=None, gradient_accumulation_steps=1,
                        modules=LAYOUTS[layout], per_device_train_batch_size=per_device,
                        save_async=layout.endswith("_async"))
