"""OmniPlugin in a plain Accelerate loop (no Trainer): the digits captioner with per-module settings.

    python examples/custom_loop.py [--steps 300]
    accelerate launch --multi_gpu --num_processes 2 examples/custom_loop.py

The whole training step is on one screen: forward, backward (no gradient sync on accumulation micro-steps),
per-module clipping, every module's optimizer and scheduler.
"""

import contextlib
import sys

import torch
from accelerate import Accelerator

from hf_omni import OmniPlugin
from hf_omni.testing.digits import build_model, caption_accuracy, load_splits

STEPS = int(sys.argv[sys.argv.index("--steps") + 1]) if "--steps" in sys.argv else 300
ACCUMULATION, BATCH = 2, 32

plugin = OmniPlugin(
    modules={"projector": {"learning_rate": 3e-3}, "llm": {"max_grad_norm": 1.0, "lr_scheduler_type": "cosine"}},
    defaults={"learning_rate": 1e-3, "warmup_steps": 0.05, "logging_steps": 50},  # `time/<module>` at these
    output_dir="runs/custom_loop",
)
accelerator = Accelerator(cpu=True)
model = build_model()
train_set, held_out = load_splits(model.processors["llm"])
model, optimizer, scheduler = plugin.prepare(accelerator, model, num_training_steps=STEPS)
loader = accelerator.prepare(torch.utils.data.DataLoader(train_set, batch_size=BATCH, shuffle=True, drop_last=True))

step, micro = 0, 0
while step < STEPS:
    for batch in loader:
        micro += 1
        last_micro_step = micro % ACCUMULATION == 0
        with contextlib.nullcontext() if last_micro_step else plugin.no_sync():
            loss = model(**batch).loss / ACCUMULATION
            accelerator.backward(loss)
        if not last_micro_step:
            continue
        grad_norm = plugin.clip_grad_norm_()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        step += 1
        if step % plugin.args.logging_steps == 0:
            accelerator.print(f"step {step}: loss {loss.item() * ACCUMULATION:.4f}, grad_norm {grad_norm.item():.3f}, "
                              f"{plugin.log_metrics()}")
        if step == STEPS:
            break

if accelerator.is_main_process:
    print(f"held-out caption accuracy: {caption_accuracy(model, held_out):.1%}")
    model.save_pretrained("runs/custom_loop/final")
