"""LoRA on a tensor-parallel module: PEFT's layers and their math kept, their weights placed by transformers' own
styles to match the base layer's.

PEFT injects in place: `q_proj` becomes a LoRA layer holding `q_proj.base_layer` (the original Linear),
`q_proj.lora_A.<adapter>` (in -> r) and `q_proj.lora_B.<adapter>` (r -> out), and computes
`base_layer(x) + lora_B(lora_A(dropout(x))) * scaling`. transformers' plan names `q_proj`; its entry moves onto
what PEFT wraps:

- a column-wise layer (output split): `base_layer` column-wise, `lora_B` column-wise (its output rows split like
  the base layer's), `lora_A` a replica (its input is the replicated `x`; the gradient of its output is summed over
  the group by `lora_B`'s input, so every replica gets the same gradient);
- a row-wise layer (input split): `base_layer` row-wise, `lora_A` row-wise (its input columns split like the base
  layer's, its r outputs summed over the group), `lora_B` a replica;
- anything else PEFT wraps on a split path (LoRA on a split embedding, DoRA, `modules_to_save`) is refused by name.

One seeded initialisation: the adapters are drawn whole on every rank before the split (PEFT's injection), then made
rank 0's on every rank (one broadcast per dtype, the adapters' bytes) and split without communication: each rank
keeps its slice of one process's adapters. `lora_dropout` draws a mask on each rank: the ranks of a group would drop
different elements of the one input a column-wise layer's replicated `lora_A` shares, and its replicas drift apart;
it is refused under tensor parallelism (`LORA_TERMS`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from ..core.errors import OmniArgumentError

SPLIT_SIDE = {"colwise": "lora_B", "colwise_gather_output": "lora_B", "rowwise": "lora_A"}  # the adapter split
LORA_TERMS = "lora_A / lora_B split like the base layer's style; lora_dropout 0, no DoRA"


def lora_problem(lora: dict) -> tuple[str, str] | None:
    """(the `lora` key, why) for a LoRA config tensor parallelism cannot serve, else None."""
    if float(lora.get("lora_dropout") or 0.0) > 0:
        return "lora.lora_dropout", ("dropout draws its mask on each rank: the ranks of one tensor-parallel group "
                                     "would drop different elements of the input their replicated lora_A shares, "
                                     "and its replicas would drift apart; set lora_dropout: 0 for this module")
    if lora.get("use_dora"):
        return "lora.use_dora", ("DoRA's weight norm is over whole rows of the split base weight; not supported under "
                                 "tensor parallelism")
    return None


def adapted_plan(model: nn.Module, plan: dict, module_name: str, key: str) -> dict:
    """`plan` with each entry naming a PEFT-wrapped layer moved onto its base layer and its split adapter (the
    module docstring); refuses, naming the module and `key`, a wrapped layer it cannot place."""
    from peft.tuners.lora import Linear
    from peft.tuners.tuners_utils import BaseTunerLayer

    modules = dict(model.named_modules())
    out = {}
    for name, style in plan.items():
        layer = modules.get(name)
        wrapper = layer is not None and type(layer).__module__.startswith("peft.")
        if not wrapper:
            out[name] = style
            continue
        if not isinstance(layer, Linear) or style not in SPLIT_SIDE or getattr(layer, "fan_in_fan_out", False) or \
                any(getattr(layer, "lora_variant", {}).values()):
            what = type(layer).__name__ if isinstance(layer, BaseTunerLayer) else f"a PEFT {type(layer).__name__}"
            raise OmniArgumentError(module_name, key, f"{name} is split `{style}` by its tensor-parallel plan and is "
                                    f"{what}: LoRA under tensor parallelism serves plain LoRA on column- and "
                                    "row-wise Linear layers only; leave it out of lora.target_modules / "
                                    "modules_to_save")
        base = f"{name}.base_layer"
        out.update(entries(base, layer.base_layer, style))
        for adapter, split in getattr(layer, SPLIT_SIDE[style]).items():
            out.update(entries(f"{name}.{SPLIT_SIDE[style]}.{adapter}", split, style))
    return out


def entries(path: str, linear: nn.Module, style: str) -> dict:
    """A Linear's plan entries: the module (its forward) and each of its own parameters (their split)."""
    return {path: style, **{f"{path}.{p}": style for p, _ in linear.named_parameters(recurse=False)}}


def same_adapters(model: nn.Module) -> None:
    """Every rank's LoRA tensors made rank 0's (one broadcast per dtype; every rank calls it in the same order)."""
    live = [p for n, p in model.named_parameters() if ".lora_" in n and not p.is_meta]
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for param in live:
        by_dtype.setdefault(param.dtype, []).append(param)
    with torch.no_grad():
        for params in by_dtype.values():
            flat = torch.cat([p.reshape(-1) for p in params])
            dist.broadcast(flat, src=0)
            offset = 0
            for param in params:
                param.copy_(flat[offset: offset + param.numel()].view_as(param))
                offset += param.numel()
