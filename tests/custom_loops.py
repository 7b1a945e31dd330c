"""A diffusers-style Accelerate loop over OmniPlugin (shared by the 1-process test and the 2-rank script):
`accelerator.prepare` of the plugin's optimizer and scheduler, `accelerator.accumulate()` around each micro-step."""

from __future__ import annotations

import torch
from helpers import tiny_data, tiny_model

from hf_omni import OmniPlugin

MODULES = {"vision": {"trainable": False}, "projector": {"learning_rate": 3e-3},
           "llm": {"lr_scheduler_type": "cosine", "max_grad_norm": 0.5}}


def accumulate_loop(composite: bool, out_dir: str, steps: int = 3, accumulation: int = 4, batch: int = 4):
    """`steps` optimizer steps of `accumulation` micro-steps. `composite`: the plugin's optimizer and scheduler go
    through `accelerator.prepare`; else each module's own (plain torch) optimizer and scheduler do. Returns the
    final state and the learning rates each module's scheduler reached."""
    from accelerate import Accelerator

    model = tiny_model()
    plugin = OmniPlugin(modules=MODULES, defaults={"learning_rate": 1e-3, "warmup_steps": 2}, output_dir=out_dir)
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=accumulation)  # after the arguments (they reset
    model, optimizer, scheduler = plugin.prepare(accelerator, model, num_training_steps=2 * steps)  # its state)
    data = tiny_data(model, batch * accumulation * steps * accelerator.num_processes)
    loader = accelerator.prepare(torch.utils.data.DataLoader(data, batch_size=batch))
    if composite:
        optimizers, schedulers = (list(x) for x in zip(accelerator.prepare(optimizer, scheduler)))
    else:
        names = list(plugin.optimizer.optimizers)
        prepared = accelerator.prepare(*plugin.optimizer.optimizers.values(), *plugin.scheduler.schedulers.values())
        optimizers, schedulers = list(prepared[:len(names)]), list(prepared[len(names):])
    for inputs in loader:
        with accelerator.accumulate(model):
            accelerator.backward(model(**inputs).loss)
            if accelerator.sync_gradients:
                plugin.clip_grad_norm_()
            for o in optimizers:
                o.step()
            for s in schedulers:
                s.step()
            for o in optimizers:
                o.zero_grad()
    lrs = {name: s.get_last_lr() for name, s in plugin.scheduler.schedulers.items()}
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, lrs


class UnevenTokens(torch.utils.data.Dataset):
    """8 captions: the first 4 keep 3 of their labels (-100 after), the last 4 keep all 8; at 2 ranks with batch 4
    rank 0 sees 12 target tokens and rank 1 sees 32."""

    def __init__(self, model):
        self.rows = [dict(tiny_data(model, 8)[i]) for i in range(8)]
        for row in self.rows[:4]:
            row["labels"] = row["labels"].clone()
            row["labels"][3:] = -100

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return self.rows[i]


AVERAGE_TOKENS = dict(max_steps=1, per_device_train_batch_size=4, optim="sgd", learning_rate=0.5,
                      lr_scheduler_type="constant", max_grad_norm=0.0, modules={"vision": {"trainable": False}})
