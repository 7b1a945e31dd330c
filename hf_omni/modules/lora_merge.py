"""Merging LoRA into an export row by row, on the ranks that hold the rows: a merged weight is W + scaling · B A,
and rows [lo, hi) of it need only rows [lo, hi) of W and of B (sharded alike on dim 0) and the whole of A (r rows:
small, gathered once per layer). So `save_pretrained(merge_lora=True)` / `merge_lora_on_export` keep the bound of
every other save: no rank holds the module.

This covers PEFT's plain LoRA on `nn.Linear` layers, one adapter, without DoRA (or another variant), a LoRA bias,
`fan_in_fan_out` or `modules_to_save`, on weights that are not tied to another; anything else is merged by PEFT
itself on a gathered copy (`lora.merged_module`).
"""

from __future__ import annotations

import torch
from torch import nn

from .lora import lora_config_of


def row_merge_plan(module: nn.Module) -> dict[str, tuple[str, str, float]] | None:
    """{base weight's name: (lora_A's name, lora_B's name, scaling)} for every adapted layer, or None when some
    layer needs PEFT's own merge."""
    from peft.tuners.lora import Linear
    from peft.tuners.tuners_utils import BaseTunerLayer

    config = lora_config_of(module)
    if config is None or getattr(config, "modules_to_save", None):
        return None
    holders: dict[int, int] = {}
    for _, tensor in module.named_parameters(remove_duplicate=False):
        holders[id(tensor)] = holders.get(id(tensor), 0) + 1
    plan = {}
    for name, layer in module.named_modules():
        if not isinstance(layer, BaseTunerLayer):
            continue
        adapters = list(layer.active_adapters)
        if not isinstance(layer, Linear) or len(adapters) != 1 or layer.fan_in_fan_out or layer.merged or any(
                getattr(layer, table, {}).get(adapters[0]) for table in ("use_dora", "lora_variant", "lora_bias")):
            return None  # another kind of layer, several adapters, DoRA or another variant, a bias in lora_B
        if holders[id(layer.get_base_layer().weight)] > 1:  # a tied weight: PEFT unties it first
            return None
        adapter = adapters[0]
        plan[f"{name}.base_layer.weight"] = (f"{name}.lora_A.{adapter}.weight", f"{name}.lora_B.{adapter}.weight",
                                             float(layer.scaling[adapter]))
    return plan


def full(tensor) -> torch.Tensor:
    """A (small) tensor whole on every rank: lora_A, r rows."""
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def merged_rows(rows: torch.Tensor, lo: int, hi: int, b, a_full: torch.Tensor, scaling: float) -> torch.Tensor:
    """Rows [lo, hi) of W + scaling · B A, from W's rows [lo, hi) (`rows`), this rank's B and the whole A."""
    from .weights import local_rows

    first = (local_rows(b) or (0, 0))[0]
    local = b.to_local() if hasattr(b, "to_local") else b
    b_rows = local[lo - first:hi - first]
    compute = torch.float32 if rows.dtype in (torch.float16, torch.bfloat16) and rows.device.type == "cpu" \
        else rows.dtype
    delta = (b_rows.to(compute) @ a_full.to(compute)) * scaling
    return rows + delta.to(rows.dtype)
