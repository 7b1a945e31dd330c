"""LoRA merged by PEFT itself (`merge_and_unload` on a plain copy gathered on the main process), for the adapters
the row-by-row merge (`lora.merge`) does not cover: the merged module, writing it alone, and the check that it fits
the limit for whole copies (`whole.WHOLE_COPY_LIMIT`) before any compute."""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn

from ..compat import own_tensors
from ..core.refusals import TUNED, refusal
from ..lora.adapters import ADAPTER_CONFIG, ADAPTER_WEIGHTS, PEFT_PREFIX, base_state_dict, lora_config_of
from ..lora.merge import row_merge_plan
from . import folder_write
from .folder_plan import plan_folder
from .format import format_of
from .whole import check_whole_copy


def merged_module(module: nn.Module, state: dict[str, torch.Tensor]) -> nn.Module:
    """A plain copy of a LoRA module with every adapter merged by PEFT itself (`merge_and_unload`: LoRA on Linear,
    Embedding and Conv layers, DoRA, rsLoRA, `modules_to_save`), built from its full `state` on CPU."""
    import copy

    from peft import get_peft_model, get_peft_model_state_dict, set_peft_model_state_dict

    plain = format_of(module).empty_copy(module)
    # copies: the merge writes into the base weights, which must not be the live module's
    plain.load_state_dict({k: v.detach().to("cpu", copy=True) for k, v in base_state_dict(state).items()},
                          assign=True)
    if hasattr(plain, "tie_weights"):
        plain.tie_weights()  # each name was assigned its own copy: tied weights one again, so the merge reaches all
    peft_model = get_peft_model(plain, copy.deepcopy(lora_config_of(module)))
    adapter = get_peft_model_state_dict(module, state_dict=state)
    result = set_peft_model_state_dict(peft_model, {PEFT_PREFIX + k: v for k, v in adapter.items()})
    if result.unexpected_keys:
        raise ValueError(f"merging LoRA: PEFT did not take {result.unexpected_keys[:5]}")
    untie_adapted_halves(peft_model)
    return peft_model.merge_and_unload()


def untie_adapted_halves(peft_model: nn.Module) -> None:
    """A tied weight with an adapter on one of its holders only (LoRA on the input embeddings, the tied output
    layer without one): training changed one side alone, so a merge into the one tensor would change the other
    side too. Those holders get their own copy before the merge, and the export's config stops tying them."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    adapted = {id(layer.get_base_layer()) for layer in peft_model.modules() if isinstance(layer, BaseTunerLayer)}
    holders: dict[int, list[tuple[nn.Module, dict, str]]] = {}
    for sub in peft_model.modules():
        for table, attr, param in own_tensors(sub, buffers=False):
            holders.setdefault(id(param), []).append((sub, table, attr))
    for group in holders.values():
        touched = [id(sub) in adapted for sub, _, _ in group]
        if len(group) > 1 and any(touched) and not all(touched):
            for (_, table, attr), is_adapted in zip(group, touched):
                if not is_adapted:
                    table[attr] = nn.Parameter(table[attr].detach().clone(), requires_grad=table[attr].requires_grad)
            peft_model.get_base_model().config.tie_word_embeddings = False



def save_merged(module: nn.Module, folder: str, state: dict[str, torch.Tensor], processor: Any = None,
                dtype: torch.dtype | None = None, max_shard_size: str | int = "50GB") -> None:
    """The main process: a LoRA module merged by PEFT itself (`merged_module`, from its gathered `state`)
    written to `folder` alone, as any module of its format is — for the adapters `lora.merge` cannot merge row by
    row. `dtype`: the module's dtype as loaded, recorded where its live parameters (fp32 masters) differ."""
    merged = merged_module(module, state)
    os.makedirs(folder, exist_ok=True)
    folder_write.remove_weight_files(folder)
    for stale in (ADAPTER_CONFIG, ADAPTER_WEIGHTS):
        if os.path.exists(os.path.join(folder, stale)):
            os.remove(os.path.join(folder, stale))
    plan = plan_folder(merged, {}, max_shard_size)
    folder_write.write_module_folder(merged, folder, plan, processor, solo=True)
    if dtype is not None:  # its own class, and the dtype as loaded (not the live parameters')
        format_of(merged).write_config(merged, folder, dtype)


def check_peft_merge(module: nn.Module, module_name: str, dtypes: dict | None = None) -> None:
    """A LoRA module whose merge needs PEFT's own (`lora.merge.row_merge_plan` is None), within the limit for whole
    copies (`whole.WHOLE_COPY_LIMIT`; its tensors in the dtypes they are exported in, `dtypes`), else the error."""
    if lora_config_of(module) is None or row_merge_plan(module) is not None:
        return
    check_whole_copy(module, module_name, "merging LoRA with PEFT's own merge (an adapter the row-by-row merge does "
                     "not cover: see `lora.merge`), gathered on the main process with its merged copy,",
                     "export without `merge_lora` (`merge_lora_on_export: false`; the adapter is written beside the "
                     "base weights) and merge it with PEFT's `merge_and_unload` on a host with room for the module "
                     "twice, or use an adapter the row-by-row merge covers (LoRA, rsLoRA or DoRA on Linear layers, "
                     "one adapter, no `fan_in_fan_out`)", dtypes)


@refusal(TUNED)
def refuse_merge_on_export(model, args) -> None:
    """With `merge_lora_on_export`, a LoRA merge the export could not do is refused now, not after training."""
    for slot in model.slots.values() if args.merge_lora_on_export else ():
        check_peft_merge(slot.module, slot.name)
