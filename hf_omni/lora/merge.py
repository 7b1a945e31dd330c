"""Merging LoRA into an export row by row, on the ranks that hold the rows: a merged weight is W + scaling · B A,
and rows [lo, hi) of it need only rows [lo, hi) of W and of B (sharded alike on dim 0) and the whole of A (r rows:
small, gathered once per layer). So `save_pretrained(merge_lora=True)` / `merge_lora_on_export` keep the bound of
every other save: no rank holds the module. W or B sharded on another dim (`Shard(1)`) is redistributed to dim-0
shards first, by every rank in plan order (`folder_write`; `shards.box.as_rows`: one all-to-all per tensor).

Row by row, as PEFT's `merge_and_unload` computes them (its dtypes and casts): plain LoRA and rsLoRA on
`nn.Linear` layers; DoRA (row r scaled by m_r / ||W_r + ΔW_r||: the norm is over the row, so a rank needs only its
rows of the magnitude vector too); a LoRA bias (the base bias's rows + scaling · lora_B's bias rows);
`modules_to_save` (the trained copy's rows written in place of the original's). Anything else — `fan_in_fan_out`,
LoRA on embeddings or convolutions, several adapters, other variants, an adapted weight tied to another — is
merged by PEFT itself on a gathered copy (`files.peft_merge`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..shards.box import local_of, local_rows, sharded_off_rows
from ..shards.device import on_group_device
from .adapters import lora_config_of


@dataclass(frozen=True)
class RowMerge:
    """How one tensor of the merged export is made from this rank's rows."""

    a: str | None = None  # lora_A's weight: whole on every rank
    b: str | None = None  # lora_B's weight (or, for `bias`, lora_B's bias): its rows
    scaling: float = 1.0
    magnitude: str | None = None  # DoRA: the magnitude vector, its rows
    bias: bool = False  # the base layer's bias: + scaling · lora_B's bias
    copy: str | None = None  # modules_to_save: the trained copy's tensor, in place of the original's
    embedding: bool = False  # LoRA on an embedding: rows of (B A)^T, from the whole of A (r x vocab) and of B

    @property
    def wholes(self) -> tuple[str, ...]:
        """The tensors every rank needs whole (gathered once per layer)."""
        return tuple(n for n in ((self.a, self.b) if self.embedding else (self.a,)) if n)


def row_merge_plan(module: nn.Module) -> dict[str, RowMerge] | None:
    """{tensor name: how its merged rows are made} for every tensor a merge changes, or None when some layer needs
    PEFT's own merge."""
    from peft.tuners.lora import Embedding, Linear
    from peft.tuners.tuners_utils import BaseTunerLayer
    from peft.utils.other import ModulesToSaveWrapper

    if lora_config_of(module) is None:
        return None
    holders: dict[int, int] = {}
    for _, tensor in module.named_parameters(remove_duplicate=False):
        holders[id(tensor)] = holders.get(id(tensor), 0) + 1
    plan = {}
    for name, layer in module.named_modules():
        if isinstance(layer, ModulesToSaveWrapper):
            copy = layer.modules_to_save[layer.active_adapter]
            persistent = set(copy.state_dict(keep_vars=True))
            prefix = f"{name}.modules_to_save.{layer.active_adapter}."
            plan.update((f"{name}.original_module.{t}", RowMerge(copy=prefix + t))
                        for t, _ in [*copy.named_parameters(), *copy.named_buffers()] if t in persistent)
            continue
        if not isinstance(layer, BaseTunerLayer):
            continue
        adapters = list(layer.active_adapters)
        if not isinstance(layer, (Linear, Embedding)) or len(adapters) != 1 or layer.merged or \
                getattr(layer, "fan_in_fan_out", False):
            return None  # another kind of layer, several adapters, a transposed weight, merged already
        adapter = adapters[0]
        variant = getattr(layer, "lora_variant", {}).get(adapter)
        if variant is not None and (isinstance(layer, Embedding) or type(variant).__name__ != "DoraLinearVariant"):
            return None  # a variant other than DoRA on a Linear layer
        if holders[id(layer.get_base_layer().weight)] > 1:  # a tied weight: PEFT unties it first
            return None
        scaling = float(layer.scaling[adapter])
        if isinstance(layer, Embedding):
            plan[f"{name}.base_layer.weight"] = RowMerge(f"{name}.lora_embedding_A.{adapter}",
                                                         f"{name}.lora_embedding_B.{adapter}", scaling, embedding=True)
            continue
        plan[f"{name}.base_layer.weight"] = RowMerge(
            f"{name}.lora_A.{adapter}.weight", f"{name}.lora_B.{adapter}.weight", scaling,
            magnitude=f"{name}.lora_magnitude_vector.{adapter}.weight" if variant is not None else None)
        if getattr(layer, "lora_bias", {}).get(adapter):
            plan[f"{name}.base_layer.bias"] = RowMerge(b=f"{name}.lora_B.{adapter}.bias", scaling=scaling, bias=True)
    return plan


def full(tensor) -> torch.Tensor:
    """A (small) tensor whole on every rank: lora_A, r rows, or an adapter of a diffusers LoRA file (gathered on
    the device its group serves, and back where its shards live: `shards.device.on_group_device`)."""
    return on_group_device(lambda t: t.full_tensor(), tensor) if hasattr(tensor, "full_tensor") else tensor


def rows_of(tensor, lo: int, hi: int) -> torch.Tensor:
    """Rows [lo, hi) of a tensor from this rank's part of it (a dim-0 shard holding them, or the whole tensor)."""

    if sharded_off_rows(tensor):
        raise ValueError("rows_of takes dim-0 shards: redistribute it first (`shards.box.as_rows`)")

    first = (local_rows(tensor) or (0, 0))[0]
    local = local_of(tensor)
    return local[lo - first:hi - first]


def lora_delta(b_rows: torch.Tensor, a_full: torch.Tensor, scaling: float) -> torch.Tensor:
    """Rows of scaling · B A as PEFT's `get_delta_weight` computes them (in float32 for half types on CPU, then
    back in B's dtype)."""
    cast = b_rows.device.type == "cpu" and b_rows.dtype in (torch.float16, torch.bfloat16)
    delta = (b_rows.float() @ a_full.float() if cast else b_rows @ a_full.to(b_rows.dtype)) * scaling
    return delta.to(b_rows.dtype) if cast else delta


def merged_rows(rows: torch.Tensor, lo: int, hi: int, spec: RowMerge, tensors: dict, wholes: dict) -> torch.Tensor:
    """Rows [lo, hi) of the merged tensor, from its rows [lo, hi) (`rows`), this rank's rows of the others named in
    `spec` and the gathered `wholes` (lora_A), in the dtype of `rows`."""
    if spec.copy is not None:
        return rows_of(tensors[spec.copy], lo, hi)
    if spec.embedding:  # PEFT: (B A)^T * scaling, in float32 for half types on CPU, then in A's dtype
        a, b = wholes[spec.a], wholes[spec.b]
        cast = b.device.type == "cpu" and a.dtype in (torch.float16, torch.bfloat16)
        delta = ((b.float() @ a[:, lo:hi].float()) if cast else (b @ a[:, lo:hi])).T * spec.scaling
        return (rows + (delta.to(a.dtype) if cast else delta)).to(rows.dtype)
    b_rows = rows_of(tensors[spec.b], lo, hi)
    if spec.bias:
        return (rows + b_rows * spec.scaling).to(rows.dtype)
    delta = lora_delta(b_rows, wholes[spec.a], spec.scaling)
    if spec.magnitude is None:
        return (rows + delta).to(rows.dtype)
    combined = rows + delta  # DoRA: each row scaled by its magnitude over its norm
    norm = torch.linalg.norm(combined, dim=1).to(combined.dtype)
    factor = rows_of(tensors[spec.magnitude], lo, hi) / norm
    return (factor.view(-1, 1) * (rows + delta)).to(rows.dtype)
