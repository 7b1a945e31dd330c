"""Bytes each module holds on this rank (parameters, gradients, optimizer state, fp32 masters), and their table.

What a user needs to choose `ddp` / `fsdp` / HSDP per module: `module_bytes` counts this rank's share from tensor
metadata alone (numel x element size; a sharded (DTensor) tensor by its local shard), so it reads no device
memory and costs nothing at any step. What it assumes:

- gradients: one per trainable parameter, in the parameter's dtype and shape as this rank holds it (the gradient
  held after backward: under FSDP2 mixed precision the sharded gradient is cast back to the sharded parameter's
  (master) dtype; under autocast the parameter's own). The transient unsharded gradients of an FSDP unit during
  its backward, and those kept across an accumulation window with `reshard_after_backward: false`, are not counted.
  Where a gradient exists its own size is taken.
- optimizer: "held" once the module's optimizer has state (every tensor of it, `step` counts included); before
  its first step "predicted" from its type: Adam / AdamW two moments in the parameter's dtype (three with
  `amsgrad`) plus a float32 `step` per parameter, SGD with momentum one buffer, SGD without none; any other
  optimizer "unknown" (0) until it has stepped.
- master: the bytes of the trainable parameters kept in a master dtype (fp32) above the dtype the module computes
  in (`slot.precision`). hf_omni keeps masters in place, as the parameters themselves (autocast and FSDP2 make the
  compute copies on the fly), so `master` is the part of `parameters` that is masters, not added to `total`.
- ema: the module's EMA shadows (`ema`): one more copy of each trained parameter as this rank holds it (its shard,
  in its dtype), added to `total`.
"""

from __future__ import annotations

import logging

import torch

from ..core.dist import is_main
from ..shards.box import local_of

logger = logging.getLogger("hf_omni")
MIB = 1024 * 1024


def nbytes(tensor: torch.Tensor) -> int:
    shard = local_of(tensor)
    return shard.numel() * shard.element_size()


def mesh_shape(module: torch.nn.Module) -> str:
    """The device mesh of its sharded parameters ("2x4": HSDP), or "-" where none is sharded."""
    param = next((p for p in module.parameters() if hasattr(p, "device_mesh")), None)
    return "x".join(str(n) for n in param.device_mesh.shape) if param is not None else "-"


def predicted_optimizer_bytes(optimizer, trainable: list[torch.Tensor]) -> int | None:
    """The state `optimizer` will hold after its first step, from its type; None where its type is not known."""
    from torch.optim import SGD, Adam, AdamW

    moments = sum(nbytes(p) for p in trainable)
    groups = optimizer.param_groups
    if isinstance(optimizer, (Adam, AdamW)):
        amsgrad = any(g.get("amsgrad") for g in groups)
        return (3 if amsgrad else 2) * moments + 4 * len(trainable)
    if isinstance(optimizer, SGD):
        return moments if any(g.get("momentum") for g in groups) else 0
    return None


def held_optimizer_bytes(optimizer) -> int:
    return sum(nbytes(v) for state in optimizer.state.values() for v in state.values() if torch.is_tensor(v))


def master_bytes(slot, trainable: list[torch.Tensor]) -> int:
    precision = slot.precision
    if precision is None or precision.master is None or precision.compute in (None, precision.master):
        return 0
    return sum(nbytes(p) for p in trainable if p.dtype == precision.master)


def module_bytes(slots: dict, optimizer=None) -> dict[str, dict]:
    """Module -> {"kind", "mesh", "parameters", "gradients", "optimizer", "optimizer_basis" ("held" | "predicted" |
    "unknown" | "-"), "master", "ema", "total"} in bytes on this rank; `optimizer`: the plugin's `ModuleOptimizers` (or
    None before they are built: then every optimizer is "-" and 0)."""
    optimizers = getattr(optimizer, "optimizers", {}) if optimizer is not None else {}
    out = {}
    for name, slot in slots.items():
        module = slot.module
        offline = slot.kind == "offline"
        params = [] if offline else list(module.parameters())
        trainable = [p for p in params if p.requires_grad]
        grads = sum(nbytes(p.grad) if p.grad is not None else nbytes(p) for p in trainable)
        opt = optimizers.get(name)
        if opt is None:
            optim, basis = 0, "-"
        elif opt.state:
            optim, basis = held_optimizer_bytes(opt), "held"
        else:
            predicted = predicted_optimizer_bytes(opt, trainable)
            optim, basis = (predicted, "predicted") if predicted is not None else (0, "unknown")
        row = {"kind": slot.kind, "mesh": "-" if offline else mesh_shape(module),
               "parameters": sum(nbytes(p) for p in params), "gradients": grads, "optimizer": optim,
               "optimizer_basis": basis, "master": master_bytes(slot, trainable),
               "ema": slot.ema.nbytes() if getattr(slot, "ema", None) is not None else 0}
        row["total"] = row["parameters"] + row["gradients"] + row["optimizer"] + row["ema"]
        out[name] = row
    return out


def format_bytes_table(rows: dict[str, dict]) -> str:
    """`module_bytes`' rows as a fixed-width table in MiB, one row per module, with a total line."""
    header = (f"{'module':<14} {'kind':<8} {'mesh':<6} {'parameters':>11} {'gradients':>10} {'optimizer':>10} "
              f"{'':<9} {'master':>8} {'ema':>8} {'total':>9}")
    lines = [header]
    for name, r in rows.items():
        lines.append(f"{name:<14} {r['kind']:<8} {r['mesh']:<6} {r['parameters'] / MIB:>11.2f} "
                     f"{r['gradients'] / MIB:>10.2f} {r['optimizer'] / MIB:>10.2f} {r['optimizer_basis']:<9} "
                     f"{r['master'] / MIB:>8.2f} {r['ema'] / MIB:>8.2f} {r['total'] / MIB:>9.2f}")
    total = sum(r["total"] for r in rows.values())
    lines.append(f"{'(all)':<14} {'':<8} {'':<6} {'':>11} {'':>10} {'':>10} {'':<9} {'':>8} {'':>8} "
                 f"{total / MIB:>9.2f}")
    lines.append("MiB on this rank; master: the fp32 masters among the parameters (in `parameters`, not added again); "
                 "ema: EMA shadows (added)")
    return "\n".join(lines)


def log_bytes_table(rows: dict[str, dict]) -> None:
    """The table at info level on logger `hf_omni`, by rank 0 (every rank computes its own rows)."""
    if is_main():
        logger.info("hf_omni: bytes per rank by module (rank 0)\n%s", format_bytes_table(rows))
