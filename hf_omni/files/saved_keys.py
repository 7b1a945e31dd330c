"""Where each tensor of a module is saved in its HF folder: the module's own tensors (`module_tensors`) and, for each
one a save writes as is, the file (weights or adapter) and the keys it goes under (`file_layout`).

The layout is traced, not guessed: meta placeholders of the module's tensors go through exactly what a save applies
(LoRA keys split off, the format's save-time key conversion, PEFT's adapter naming), and a placeholder that comes
out under some key, as the same object, is stored there as is.
"""

from __future__ import annotations

import torch
from torch import nn

from ..lora.adapters import adapter_state_dict, base_state_dict, lora_config_of
from .folder_plan import ADAPTER, WEIGHTS
from .format import format_of


def module_tensors(module: nn.Module) -> dict[str, torch.Tensor]:
    """Every tensor a module's state is made of: its parameters (tied ones once) and persistent buffers."""
    persistent = set(module.state_dict(keep_vars=True))
    tensors = dict(module.named_parameters())
    tensors.update((n, b) for n, b in module.named_buffers() if n in persistent)
    return tensors


def file_layout(module: nn.Module) -> dict[str, tuple[str, list[str]]]:
    """Tensor name -> (WEIGHTS | ADAPTER, the keys it may be stored under) for each tensor a save writes as
    is; a tied tensor has one key per name it goes by (transformers keeps one of them in the file)."""
    persistent = set(module.state_dict(keep_vars=True))
    owner, placeholders = {}, {}
    for name, t in module_tensors(module).items():
        owner[id(t)] = name
    every = list(module.named_parameters(remove_duplicate=False)) + [
        (n, b) for n, b in module.named_buffers(remove_duplicate=False) if n in persistent]
    made = {}
    for name, t in every:
        if id(t) not in made:
            made[id(t)] = (torch.empty(tuple(t.shape), dtype=t.dtype, device="meta"), owner[id(t)])
        placeholders[name] = made[id(t)][0]
    canonical = {id(ph): name for ph, name in made.values()}
    layout: dict[str, tuple[str, list[str]]] = {}
    fmt = format_of(module)
    for key, t in fmt.convert_keys(fmt.save_view(module), base_state_dict(placeholders)).items():
        if id(t) in canonical:
            layout.setdefault(canonical[id(t)], (WEIGHTS, []))[1].append(key)
    if lora_config_of(module) is not None:
        for key, t in adapter_state_dict(module, placeholders).items():
            if id(t) in canonical:
                entry = layout.get(canonical[id(t)])
                if entry is None or entry[0] != ADAPTER:
                    entry = layout[canonical[id(t)]] = (ADAPTER, [])
                entry[1].append(key)
    return layout
