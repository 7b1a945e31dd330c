"""Master weights: the dtype a module's trainable parameters (and so their gradients and optimizer state) are kept
in, apart from the dtype it computes in and the dtype it was loaded in.

Released LLMs ship bf16 files and transformers 5 loads them in bf16. Trained as loaded, a bf16 parameter loses
every update smaller than bf16's spacing (at a learning rate of 1e-6 nearly all of them). So a trainable module
keeps fp32 masters whenever the run computes in lower precision, and computes in that precision (an FSDP2
`MixedPrecisionPolicy` for a sharded module, the run's autocast for the others):

    master_dtype: auto       fp32 when the run computes in bf16 / fp16 (Trainer's `bf16` / `fp16`, Accelerate's
                             `mixed_precision`, or the module's own `fsdp_plugin.mixed_precision`); else as loaded
    master_dtype: float32    fp32 always
    master_dtype: bfloat16   bf16 (pure-bf16 training: updates below bf16's spacing are lost; said once in the log)

Only trainable parameters change dtype, with the floating persistent buffers of the layers that own them
(BatchNorm's running statistics must match its weight): frozen modules, frozen parts (LoRA bases) and other
buffers keep theirs; LoRA adapters follow `master_dtype`. What a module exports (`save_pretrained`, a checkpoint's HF folder) stays in the
dtype each tensor was loaded in (what users serve); a checkpoint keeps the masters beside the optimizer state, in
`state/`, so a resume is bitwise.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch
from torch import nn

logger = logging.getLogger(__name__)

MASTER_DTYPES = ("auto", "float32", "bfloat16")
LOW = {"bf16": torch.bfloat16, "fp16": torch.float16}  # Accelerate's mixed-precision names that compute lower


@dataclass
class Precision:
    """One module's dtypes as prepared: `master` (None: as loaded), `compute` (None: as its parameters), and the
    dtype each cast tensor was loaded in, by parameter name (`masters`) and by state-dict key (`loaded`); `dtype`:
    the module's dtype as loaded (what transformers records for it), where a master weight changed it."""

    master: torch.dtype | None = None
    compute: torch.dtype | None = None
    dtype: torch.dtype | None = None
    masters: dict[str, torch.dtype] = field(default_factory=dict)
    loaded: dict[str, torch.dtype] = field(default_factory=dict)

    def export(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """`state` (a full state dict) with every master tensor back in the dtype it was loaded in."""
        if not self.loaded:
            return state
        return {k: v.to(self.loaded[k]) if k in self.loaded and torch.is_tensor(v) else v for k, v in state.items()}


def run_compute_dtype(accelerator) -> torch.dtype | None:
    """The dtype the run computes in below fp32 (Accelerate's `mixed_precision`), or None."""
    return LOW.get(str(getattr(accelerator, "mixed_precision", "no") or "no"))


def module_compute_dtype(slot, run_dtype: torch.dtype | None) -> torch.dtype | None:
    """The dtype the module's strategy computes in under its settings (FSDP's `mixed_precision`), else the run's."""
    return slot.args.strategy.compute_dtype(slot.settings, run_dtype)


def resolve_master(choice: str, compute: torch.dtype | None) -> torch.dtype | None:
    """The master dtype of a trainable module's trainable parameters (None: keep each as loaded)."""
    if choice == "float32" or (choice == "auto" and compute is not None):
        return torch.float32
    if choice == "bfloat16":
        return torch.bfloat16
    return None


@torch.no_grad()
def apply_master_dtype(slot, run_dtype: torch.dtype | None, cast: bool = True) -> Precision:
    """The master dtype of `slot`'s trainable parameters, with the floating persistent buffers of the layers that
    own them (BatchNorm's running statistics must match its weight), recording what each was loaded in; `cast`:
    cast them in place now (`cast_masters`; before the module is placed or wrapped, on the meta device too), else
    the caller casts its shares once it is sharded. Frozen modules are left as they are."""
    margs, module = slot.args, slot.module
    compute = module_compute_dtype(slot, run_dtype)
    if not slot.trains:
        return Precision(compute=compute)
    master = resolve_master(margs.master_dtype, compute)
    precision = Precision(master=master, compute=compute)
    trainable = {name: p for name, p in module.named_parameters() if p.requires_grad and p.is_floating_point()}
    first = next(((n, p.dtype) for n, p in module.named_parameters() if p.is_floating_point()), None)
    if master is not None:
        cast_ids = set()
        for name, param in trainable.items():
            if param.dtype != master:
                precision.masters[name] = param.dtype
                cast_ids.add(id(param))
        for prefix, sub in module.named_modules():
            if not any(id(p) in cast_ids for p in sub.parameters(recurse=False)):
                continue
            for attr, buf in list(sub.named_buffers(recurse=False)):
                if (buf.is_floating_point() and buf.dtype != master
                        and attr not in sub._non_persistent_buffers_set):
                    precision.masters[f"{prefix}.{attr}" if prefix else attr] = buf.dtype
        named = {**dict(module.named_parameters()), **dict(module.named_buffers())}
        dtypes = {id(named[n]): d for n, d in precision.masters.items()}
        precision.loaded = {key: dtypes[id(t)] for key, t in module.state_dict(keep_vars=True).items()
                            if id(t) in dtypes}
        if first is not None and first[0] in precision.masters:
            precision.dtype = first[1]
        if cast:
            cast_masters(module, precision)
    trained = {precision.master if n in precision.masters else p.dtype for n, p in trainable.items()}
    if torch.bfloat16 in trained or torch.float16 in trained:
        why = "master_dtype: bfloat16" if margs.master_dtype == "bfloat16" else (
            "loaded so, and the run computes in fp32 (master_dtype: auto)")
        logger.warning("hf_omni: module %r trains %s parameters (%s): updates smaller than their spacing are lost; "
                       "master_dtype: float32 keeps fp32 masters", slot.name,
                       "/".join(sorted(str(d).removeprefix("torch.") for d in trained)), why)
    return precision


@torch.no_grad()
def cast_masters(module, precision: Precision) -> None:
    """The tensors `precision.masters` names, in the master dtype, in place. A sharded module (its parameters
    DTensors, cast after wrapping) casts its local shares only: each rank allocates its 1 / world of the masters,
    never the whole module; such a parameter keeps its identity (`torch.utils.swap_tensors`: FSDP2's references
    and tied holders see the cast), and its strategy's lazy init (`Strategy.after_reading`) comes after."""
    if precision.master is None or not precision.masters:
        return
    params = dict(module.named_parameters())
    for name, param in params.items():
        if name not in precision.masters or param.dtype == precision.master:
            continue
        if hasattr(param, "placements"):  # a DTensor: its local shard cast, the parameter object kept
            cast = nn.Parameter(param.detach().to(precision.master), requires_grad=param.requires_grad)
            torch.utils.swap_tensors(param, cast)
        else:
            param.data = param.data.to(precision.master)
    for name in precision.masters:
        if name in params:
            continue
        owner, _, attr = name.rpartition(".")
        sub = module.get_submodule(owner)
        sub._buffers[attr] = sub._buffers[attr].to(precision.master)
