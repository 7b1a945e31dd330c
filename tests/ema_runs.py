"""Per-module EMA (`modules.<name>.ema`) over a plain Accelerate loop of OmniPlugin, shared by the 1-process test
(tests/test_ema.py) and the 2-rank script (tests/scripts/mp_ema.py): the toy-format composition (tests/toy_runs.py)
trained 4 steps with EMA on both modules, checkpointed at step 2 (`save_async`: the shadows are staged before
the next step changes them), exported with `export_ema` on the toy module,
and resumed from step 2. Every rank calls it; tensors come back full (sharded DTensors gathered) on CPU."""

from __future__ import annotations

import os

import torch
from helpers import full_state
from toy_runs import ToyData, toy_model

from hf_omni import OmniPlugin, ema_weights

MODULES = {"toy": {"learning_rate": 1e-2, "ema": {"decay": 0.9, "update_after_step": 1, "use_ema_warmup": True},
                   "export_ema": True},
           "llm": {"learning_rate": 1e-3, "ema": {"decay": 0.8}}}
STEPS, SAVE_AT = 4, 2


def full(tensor: torch.Tensor) -> torch.Tensor:
    return (tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor).detach().cpu().clone()


def ema_state(model) -> dict:
    """Module -> {"step": its EMA counter, "shadows": {param: full tensor}}."""
    return {name: {"step": slot.ema.optimization_step, "shadows": {k: full(s) for k, s in slot.ema.shadows.items()}}
            for name, slot in model.slots.items() if slot.ema is not None}


def prepared(out: str, modules: dict):
    from accelerate import Accelerator

    model = toy_model()
    plugin = OmniPlugin(modules=modules, defaults={"max_grad_norm": 1.0, "save_async": True}, output_dir=out)
    accelerator = Accelerator(cpu=True)
    plugin.prepare(accelerator, model, num_training_steps=STEPS)
    return model, plugin, accelerator


def train(model, plugin, accelerator, batch: int, steps: range) -> list[float]:
    import torch.distributed as dist

    group = dist.is_available() and dist.is_initialized()
    data, world, rank = ToyData(), dist.get_world_size() if group else 1, dist.get_rank() if group else 0
    losses = []
    for step in steps:  # each rank its rows of the global batch (world x batch rows a step)
        rows = [data[(step * world + rank) * batch + i] for i in range(batch)]
        loss = model(**{k: torch.stack([row[k] for row in rows]) for k in rows[0]}).loss
        accelerator.backward(loss)
        plugin.clip_grad_norm_()
        plugin.optimizer.step()
        plugin.scheduler.step()
        plugin.optimizer.zero_grad()
        losses.append(float(loss.detach()))
    return losses


def run(out: str, modules: dict = MODULES, batch: int = 4) -> dict:
    model, plugin, accelerator = prepared(os.path.join(out, "run"), modules)
    bytes_rows = plugin.module_bytes()
    toy = model.slots["toy"].ema  # under FSDP: every shadow a DTensor with its parameter's placements
    placements = {n: hasattr(s, "placements") and s.placements == toy.params[n].placements
                  for n, s in toy.shadows.items()}
    losses = train(model, plugin, accelerator, batch, range(SAVE_AT))
    plugin.save_state(os.path.join(out, "checkpoint-2"), step=SAVE_AT)
    ema_at_save = ema_state(model)
    losses += train(model, plugin, accelerator, batch, range(SAVE_AT, STEPS))  # while the save is written
    plugin.wait_for_save()
    live, ema = full_state(model), ema_state(model)
    model.save_pretrained(os.path.join(out, "export"))  # toy: export_ema
    restored = full_state(model)
    with ema_weights(model, modules=["llm"]):
        llm_swapped = {k: v for k, v in full_state(model).items() if k.startswith("llm.")}
    again, plugin2, accelerator2 = prepared(os.path.join(out, "resumed"), modules)
    plugin2.load_state(os.path.join(out, "checkpoint-2"))
    ema_loaded = ema_state(again)
    resumed_losses = train(again, plugin2, accelerator2, batch, range(SAVE_AT, STEPS))
    return {"losses": losses, "live": live, "ema": ema, "ema_at_save": ema_at_save, "restored": restored,
            "llm_swapped": llm_swapped, "ema_loaded": ema_loaded, "resumed_losses": resumed_losses,
            "resumed_live": full_state(again), "resumed_ema": ema_state(again),
            "bytes": {n: r["ema"] for n, r in bytes_rows.items()},
            "dtensor_shadows": placements}
