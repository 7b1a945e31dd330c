"""Step-time overhead of OmniTrainer on the demo model, 2 gloo ranks on CPU, measured side by side.

    python bench/overhead.py            # launches itself with accelerate (2 processes)

Variants, interleaved over rounds so that machine noise hits all of them alike:
  omni       OmniTrainer with the demo's per-module settings (projector at 3x the learning rate)
  reference  a hand-written loop: the same modules replicated in place (composable replicate, with the DDP
             settings OmniTrainer resolves by default: find_unused_parameters=True, Trainer's own default without
             activation checkpointing), the same global token normalisation, one AdamW + scheduler per module,
             per-module clipping
  trainer    plain transformers.Trainer, DDP over the whole model, the same learning rates as param groups
  omni_unprofiled        OmniTrainer with the per-module profile timing no step (its hooks never on)
  omni_every_step_timed  OmniTrainer with the profile timing every step (what a logging step costs)
Prints the median step time of each, the ratios omni / reference and omni / trainer, and the profile's A/B per round
(the steps here log never: `omni` runs none of the profile's hooks, as any step that does not end in a log).
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(ROOT, "tests"))
from launching import end_distributed, free_port  # noqa: E402
from timing import StepTimer  # noqa: E402

WARMUP, MEASURED, ROUNDS, BATCH = 10, 60, 5, 64
LRS = {"vision": 1e-3, "projector": 3e-3, "llm": 1e-3}
TOTAL_STEPS = WARMUP + MEASURED


def launch():
    cmd = ["accelerate", "launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1",
           "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", str(free_port()), __file__,
           "--worker"]
    sys.exit(subprocess.call(cmd))


def _args(output_dir, **kw):
    from hf_omni import OmniTrainingArguments

    return OmniTrainingArguments(
        output_dir=output_dir, max_steps=TOTAL_STEPS, per_device_train_batch_size=BATCH, learning_rate=1e-3,
        lr_scheduler_type="cosine", use_cpu=True, report_to="none", save_strategy="no", disable_tqdm=True,
        logging_steps=10_000, dataloader_drop_last=True, optim="adamw_torch", seed=0, **kw)



def profile_steps(timed):
    """A callback making the per-module profile time the steps `timed` names (it runs before OmniTrainer's own
    step callback, which then turns the hooks on or off by it)."""
    from transformers import TrainerCallback

    class Timed(TrainerCallback):
        def __init__(self):
            self.trainer = None

        def on_step_begin(self, args, state, control, **kwargs):
            self.trainer.plugin.profile.timed = timed

    return Timed()


def run_omni(train_set, timed=None):
    """OmniTrainer; `timed`: which steps the profile times (None: as built, the logging steps, so none here)."""
    from hf_omni import OmniTrainer
    from hf_omni.testing.digits import build_model

    timer = StepTimer()
    model = build_model()
    modules = {name: {"learning_rate": lr} for name, lr in LRS.items()}
    callbacks = [timer.callback()] + ([profile_steps(timed)] if timed is not None else [])
    trainer = OmniTrainer(model=model, args=_args("/tmp/hf_omni_bench/omni", modules=modules),
                          train_dataset=train_set, callbacks=callbacks)
    for callback in callbacks[1:]:
        callback.trainer = trainer
    trainer.train()
    return timer.measured(WARMUP)


def run_trainer(train_set):
    import torch
    from transformers import Trainer, TrainingArguments

    from hf_omni.testing.digits import build_model

    timer = StepTimer()
    model = build_model()
    groups = [{"params": list(getattr(model, n).parameters()), "lr": lr} for n, lr in LRS.items()]
    optimizer = torch.optim.AdamW(groups, lr=1e-3)
    args = TrainingArguments(
        output_dir="/tmp/hf_omni_bench/trainer", max_steps=TOTAL_STEPS, per_device_train_batch_size=BATCH,
        learning_rate=1e-3, lr_scheduler_type="cosine", use_cpu=True, report_to="none", save_strategy="no",
        disable_tqdm=True, logging_steps=10_000, dataloader_drop_last=True, seed=0)
    trainer = Trainer(model=model, args=args, train_dataset=train_set, optimizers=(optimizer, None),
                      callbacks=[timer.callback()])
    trainer.train()
    return timer.measured(WARMUP)


def run_reference(train_set):
    import torch
    from accelerate import Accelerator
    from torch.distributed._composable.replicate import replicate
    from transformers import get_scheduler

    from hf_omni.testing.digits import build_model

    accelerator = Accelerator(cpu=True)
    model = build_model()
    optimizers, schedulers = {}, {}
    for name, lr in LRS.items():
        module = getattr(model, name)
        replicate(module, find_unused_parameters=True)  # as OmniTrainer's ddp modules (DDP's graph walk: ~3 ms)
        replicate.state(module).lazy_init()
        optimizers[name] = torch.optim.AdamW(module.parameters(), lr=lr)
        schedulers[name] = get_scheduler("cosine", optimizers[name], num_warmup_steps=0,
                                         num_training_steps=TOTAL_STEPS)
    loader = accelerator.prepare(torch.utils.data.DataLoader(train_set, batch_size=BATCH, shuffle=True,
                                                             drop_last=True))
    timer = StepTimer()
    model.train()
    step = 0
    while step < TOTAL_STEPS:
        for batch in loader:
            # the same global token normalisation Trainer applies (sum over all ranks' targets)
            num_items = (batch["labels"] != -100).sum()
            torch.distributed.all_reduce(num_items)
            loss = model(**batch, num_items_in_batch=num_items).loss * accelerator.num_processes
            loss.backward()
            for name in LRS:
                torch.nn.utils.clip_grad_norm_(getattr(model, name).parameters(), 1.0)
            for name in LRS:
                optimizers[name].step()
                schedulers[name].step()
                optimizers[name].zero_grad()
            timer.tick()
            step += 1
            if step == TOTAL_STEPS:
                break
    return timer.measured(WARMUP)


def worker():
    import torch.distributed as dist

    from hf_omni.testing.digits import build_tokenizer, load_splits

    train_set, _ = load_splits(build_tokenizer())
    runs = {"omni": run_omni, "reference": run_reference, "trainer": run_trainer,
            "omni_unprofiled": lambda data: run_omni(data, timed=lambda step: False),
            "omni_every_step_timed": lambda data: run_omni(data, timed=lambda step: True)}
    times = {name: [] for name in runs}
    rounds = {name: [] for name in runs}  # each round's median, ms
    for _ in range(ROUNDS):
        for name, fn in runs.items():
            measured = fn(train_set)
            times[name] += measured
            rounds[name].append(statistics.median(measured) * 1000)
            dist.barrier()
    if dist.get_rank() == 0:
        median = {name: statistics.median(t) * 1000 for name, t in times.items()}
        print(f"\nbench/overhead.py: demo model, 2 gloo ranks, batch {BATCH}/rank, "
              f"{ROUNDS} rounds x {MEASURED} measured steps")
        print("| variant | median step (ms) |")
        print("|---|---|")
        for name, value in median.items():
            print(f"| {name} | {value:.1f} |")
        print("\n| ratio | value | goal |")
        print("|---|---|---|")
        print(f"| OmniTrainer / reference loop | {median['omni'] / median['reference']:.3f} | <= 1.03 |")
        print(f"| OmniTrainer / plain Trainer (DDP) | {median['omni'] / median['trainer']:.3f} | <= 1.02 |")
        print("\nThe per-module profile, A/B per round (ms per step; positive: the profile costs):")
        print("| round | steps not logged: omni - unprofiled | a timed step: every_step_timed - unprofiled |")
        print("|---|---|---|")
        for i in range(ROUNDS):
            print(f"| {i + 1} | {rounds['omni'][i] - rounds['omni_unprofiled'][i]:+.2f} | "
                  f"{rounds['omni_every_step_timed'][i] - rounds['omni_unprofiled'][i]:+.2f} |")
        print(f"| median | {median['omni'] - median['omni_unprofiled']:+.2f} "
              f"({(median['omni'] / median['omni_unprofiled'] - 1) * 100:+.1f}%; goal <= 0.3 ms or <= 1%) | "
              f"{median['omni_every_step_timed'] - median['omni_unprofiled']:+.2f} |")


if __name__ == "__main__":
    if "--worker" in sys.argv:
        worker()
        end_distributed()  # groups destroyed, output flushed, then os._exit: see tests/launching.py
    else:
        launch()
