"""An adopted model written in its released class's own format: the folder machinery of module exports
(`files.folder_plan` / `folder_write`) run on the released model itself, whose tensors are its modules' —
so the keys are what the class's `save_pretrained` writes (transformers' save-time conversion, tied aliases
dropped), each rank writes its own rows of sharded tensors in place, and LoRA is merged row by row."""

from __future__ import annotations

import functools
import os

from ..core.dist import agreed, checkpoint_group, is_main
from ..files.folder_plan import plan_folder
from ..files.folder_write import has_shards, remove_weight_files, write_module_folder
from ..files.saved_keys import module_tensors
from ..files.weights import fill_module
from ..lora.adapters import lora_config_of
from ..lora.merge import row_merge_plan


def merge_plan(model) -> dict | None:
    """The row-by-row LoRA merge of every module with an adapter (`lora.merge.row_merge_plan`), keyed by the
    released model's tensor names (a module's names are the released model's)."""

    merge = {}
    for name, slot in model.slots.items():
        if lora_config_of(slot.module) is None:
            continue
        plan = row_merge_plan(slot.module)
        if plan is None:
            raise ValueError(f"module {name!r}: its LoRA layers cannot be merged row by row (LoRA on convolutions, "
                             "several adapters, fan_in_fan_out): an adopted model's export holds merged weights only")
        merge.update(plan)
    return merge or None


def export_original(model, folder: str, is_main_process: bool, max_shard_size) -> None:
    """Every rank with sharded modules (each its rows); otherwise the main process alone. An offline module (on
    the meta device) is written by the process that writes the small files alone: only it reads the module back
    from its recorded source, on the CPU, and drops it after the write (one read of the module's files per save,
    one process holding it meanwhile: a frozen tower, never what every rank holds or reads)."""
    import torch

    offline = [slot for slot in model.slots.values() if slot.is_offline]
    ids = {id(t) for slot in offline for t in module_tensors(slot.module).values()}
    main_only = frozenset(n for n, t in module_tensors(model.released).items() if id(t) in ids)
    sharded = has_shards(model.released)
    writer = offline and (is_main() if sharded else is_main_process)

    def read_back():
        for slot in offline if writer else ():
            fill_module(slot.module, slot.entry.source, torch.device("cpu"), slot.name)

    if offline and sharded:  # every rank writes after this: each learns the reader's outcome, and all raise alike
        with agreed(f"adopted model: reading {[s.name for s in offline]} back for {folder}", checkpoint_group()):
            read_back()
    else:
        read_back()
    try:
        write_original(model, folder, is_main_process, max_shard_size, main_only)
    finally:
        for slot in offline if writer else ():
            slot.module.to("meta")


def write_original(model, folder: str, is_main_process: bool, max_shard_size, main_only: frozenset) -> None:
    released = model.released
    dtypes = {k: v for slot in model.slots.values() for k, v in slot.export_dtypes.items()}
    merge = merge_plan(model)
    plan = plan_folder(released, dtypes, max_shard_size, merged=merge is not None)
    write = functools.partial(write_module_folder, released, folder, plan, model.adopted_processor, dtypes=dtypes,
                              merge=merge, main_only=main_only)
    if not has_shards(released):
        if is_main_process:
            os.makedirs(folder, exist_ok=True)
            remove_weight_files(folder)
            write(solo=True)
        return
    with agreed(f"adopted model: preparing {folder}", checkpoint_group()):
        if is_main():
            os.makedirs(folder, exist_ok=True)
            remove_weight_files(folder)
    with agreed(f"adopted model: writing {folder}", checkpoint_group()):
        write()


def module_folder_root(model, name: str):
    """The one `PreTrainedModel` module `name` is, or an error saying why it has no folder of its own."""
    from transformers import PreTrainedModel

    if name not in model.slots:
        raise ValueError(f"module_folders: {name!r} is not a module of the adopted model {model.module_names}")
    slot = model.slots[name]
    roots = slot.module.omni_roots
    if len(roots) != 1 or roots[0].carved or slot.module.omni_tensors or not isinstance(roots[0].module,
                                                                                        PreTrainedModel):
        paths = slot.module.omni_paths
        raise ValueError(f"module_folders: module {name!r} ({paths}) is not one PreTrainedModel with all its "
                         "tensors: only such a module has an HF folder of its own")
    if lora_config_of(slot.module) is not None:
        raise ValueError(f"module_folders: module {name!r} has LoRA adapters; its weights are exported merged in the "
                         "released files only")
    return slot, roots[0]


def export_module_folders(model, directory: str, names: list[str], is_main_process: bool, max_shard_size) -> None:
    """`<directory>/<module>/`: each named module as the HF folder of its `PreTrainedModel` (its class's own
    `save_pretrained` format, loadable alone), written as a composed model's modules are."""

    chosen = [module_folder_root(model, name) for name in names]  # every refusal before anything is written
    for slot, root in chosen:
        folder = os.path.join(directory, slot.name)
        prefix = root.path + "."
        dtypes = {k[len(prefix):]: v for k, v in slot.export_dtypes.items() if k.startswith(prefix)}
        plan = plan_folder(root.module, dtypes, max_shard_size)
        write = functools.partial(write_module_folder, root.module, folder, plan, None, dtypes=dtypes)
        if not has_shards(root.module):
            if is_main_process:
                os.makedirs(folder, exist_ok=True)
                remove_weight_files(folder)
                write(solo=True)
            continue
        with agreed(f"module {slot.name!r}: preparing {folder}", checkpoint_group()):
            if is_main():
                os.makedirs(folder, exist_ok=True)
                remove_weight_files(folder)
        with agreed(f"module {slot.name!r}: writing {folder}", checkpoint_group()):
            write()
