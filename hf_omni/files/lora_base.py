"""A LoRA module's frozen base, written once per run and referenced by each checkpoint instead of rewritten.

    <output_dir>/frozen/<module>-<token>/   config.json, model*.safetensors (+ index), hf_omni_base.json (last)
    <checkpoint>/<module>/                  config.json, adapter_config.json, adapter_model.safetensors, processor,
                                            state/ — no base weights

`adapter_config.json`'s `base_model_name_or_path` is the base folder's absolute path, so transformers' and PEFT's
own loaders (`AutoModel*.from_pretrained(<checkpoint>/<module>)`, `AutoPeftModel*`) load the folder as is where the
run wrote it. When the run folder moves, hf_omni finds the base by its name (unique per write: the token) in a
`frozen/` folder of the module folder's parents (`find_base`). A base is named by a fresh token at every write, so
a new run never overwrites a base that an older checkpoint refers to.
"""

from __future__ import annotations

import json
import os

from torch import nn

from ..compat import keeps_running_stats
from ..lora.adapters import ADAPTER_CONFIG, has_adapter, lora_config_of
from .folder_plan import ADAPTER
from .format import weights_names
from .saved_keys import file_layout

BASE_MARKER = "hf_omni_base.json"
FROZEN = "frozen"
SEARCH_DEPTH = 4  # parents of a module folder searched for frozen/<name>/


def has_fixed_base(module: nn.Module) -> bool:
    """A LoRA module whose base cannot change in training: every parameter that trains lives in the adapter file
    (LoRA matrices, DoRA magnitudes, `modules_to_save` copies), and no layer keeps running statistics."""

    if lora_config_of(module) is None:
        return False
    if any(keeps_running_stats(m) for m in module.modules()):
        return False
    layout = file_layout(module)
    return all(layout.get(name, (None,))[0] == ADAPTER for name, p in module.named_parameters() if p.requires_grad)


def has_weights(folder: str) -> bool:
    return any(os.path.isfile(os.path.join(folder, n)) for n in weights_names(folder))


def base_reference(folder: str) -> str | None:
    """The `base_model_name_or_path` of a module folder's adapter config that holds no base weights itself."""
    if not has_adapter(folder) or has_weights(folder):
        return None
    with open(os.path.join(folder, ADAPTER_CONFIG)) as f:
        return json.load(f).get("base_model_name_or_path") or None


def find_base(start: str, name: str, reference: str | None = None) -> str:
    """The base folder `name` (with its marker): at `reference` when it is there, else in `frozen/` of `start` or
    one of its parents (a run folder that moved; the name's token makes it that base and no other). A clear error
    when it is nowhere."""
    if not name or name in (".", "..") or "/" in name or "\\" in name:
        raise ValueError(f"{start}: {name!r} is not the name of a frozen folder")
    if reference and os.path.isabs(reference) and os.path.basename(os.path.normpath(reference)) == name and \
            os.path.isfile(os.path.join(reference, BASE_MARKER)):
        return reference
    here = os.path.abspath(start)
    for _ in range(SEARCH_DEPTH):
        candidate = os.path.join(here, FROZEN, name)
        if os.path.isfile(os.path.join(candidate, BASE_MARKER)):
            return candidate
        here = os.path.dirname(here)
    raise FileNotFoundError(f"{start}: its LoRA base {name} is neither at {reference or 'its recorded path'} nor in a "
                            f"{FROZEN}/ folder beside it: move a checkpoint together with its run's {FROZEN}/ folder, "
                            "or export it first (`hf-omni export`, which copies the base in)")


def weights_folder(folder: str) -> str:
    """Where a module folder's base weights are: the folder itself, or the hf_omni base it refers to. A reference
    to anything else (a Hub id) is left to transformers' own adapter loading."""
    reference = base_reference(folder)
    if reference is None:
        return folder
    name = os.path.basename(os.path.normpath(reference))
    if os.path.basename(os.path.dirname(os.path.normpath(reference))) != FROZEN:
        return folder
    return find_base(folder, name, reference)


def read_base_marker(folder: str) -> dict:
    with open(os.path.join(folder, BASE_MARKER)) as f:
        return json.load(f)
