"""The adopted composition (`OmniModel.from_model`): a released composite model (LLaVA, Qwen2.5-VL, ...) trained
per module as it is (`adopt.model.AdoptedModel`), saved in the released class's own format.

    out/config.json, generation_config.json, model*.safetensors, processor files    the released class's own save
    out/hf_omni.json           the `modules=` mapping and the class: `OmniModel.from_pretrained(out)` adopts it again
    <checkpoint>/<module>/     each module's tensors under the released names (`hf_omni_part.json`), `state/`
    <checkpoint>/released/     the released format too (what `hf-omni export` copies and a push uploads)
"""

from __future__ import annotations

import dataclasses
import os

from transformers import PreTrainedModel

from ..adopt.export import export_module_folders, export_original, module_folder_root
from ..adopt.hub_push import check_released_layout, push_released
from ..adopt.model import AdoptedModel
from ..adopt.saved import ADOPTED_FILE, RELEASED_FOLDER, adopted_folder, released_files
from ..core.config import OmniConfig
from ..files.composition import Composition, register_composition
from ..files.empty_init import build_empty
from ..files.folder import copy_module_folder
from ..formats.transformers_classes import resolve_module_class
from ..hub.download import download_module
from ..hub.ids import is_hub_id
from ..modules.ema import ema_weights

PROCESSOR_FILES = ("processor_config.json", "preprocessor_config.json", "tokenizer_config.json")


@register_composition
class AdoptedComposition(Composition):
    name = "adopted"
    description = "a released composite model adopted as it is (`from_model`), saved in its own format"

    def holds(self, config) -> bool:
        return getattr(config, "adopted", None) is not None

    def recognises(self, root: str, revision=None, token=None, cache_dir=None) -> bool:
        return adopted_folder(root, revision, token, cache_dir)

    def owns_saved(self, root: str) -> bool:
        return released_files(root) is not None

    # -- building ---------------------------------------------------------------------------------
    def compose(self, cls, model, pretrained=None, *, modules: dict, processor=None, empty_init: bool = False,
                **kwargs) -> AdoptedModel:
        """`from_model(instance, modules=...)`, or `from_model(ReleasedClass, "folder-or-repo", modules=...,
        **from_pretrained_kwargs)`: the class's own `from_pretrained` loads it (every rank its copy).
        `empty_init=True`: built on the meta device instead, each module pending on the released files, which
        `OmniPlugin.prepare` reads after wrapping (a sharded module: each rank its own rows)."""
        if isinstance(model, type):
            if not issubclass(model, PreTrainedModel) or pretrained is None:
                raise TypeError("from_model(cls, path, modules=...): cls a transformers model class and path its "
                                "folder or repo id")
            if empty_init:
                return adopt_empty(model, str(pretrained), modules, processor, **kwargs)
            model = model.from_pretrained(pretrained, **kwargs)
            kwargs = {}
        elif pretrained is not None or empty_init:
            raise TypeError("from_model(instance, modules=...) takes no path and no empty_init: the instance holds "
                            "its weights (empty_init: from_model(cls, path, ...))")
        return AdoptedModel.adopt(model, modules, processor=processor, **kwargs)

    def load(self, cls, root: str, *, empty_init: bool = False, device_map=None, dtype=None,
             merge_lora: bool = False, revision=None, token=None, cache_dir=None, **kwargs) -> AdoptedModel:
        """A folder `save` wrote (or a repo it was pushed to): the released class loads it, then it is adopted
        with its mapping."""
        folder = download_module(root, revision, "(adopted model)", token, cache_dir) if is_hub_id(root) else root
        config = OmniConfig.from_json_file(os.path.join(folder, ADOPTED_FILE))
        released_class = resolve_module_class(config.adopted["class"], "(adopted model)")
        released = released_class.from_pretrained(folder, **kwargs)
        processor = None
        if any(os.path.isfile(os.path.join(folder, n)) for n in PROCESSOR_FILES):
            from transformers import AutoProcessor

            processor = AutoProcessor.from_pretrained(folder)
        return AdoptedModel.adopt(released, {e.name: e.extra["paths"] for e in config.modules},
                                  processor=processor).eval()

    # -- saving -----------------------------------------------------------------------------------
    def save(self, model, directory: str, *, is_main_process: bool, merge_lora: bool, max_shard_size,
             module_folders: list[str] | None = None, **kwargs) -> None:
        """The released class's own format, written as modules are (every rank its own rows of a sharded module's
        tensors), and `hf_omni.json`. LoRA is always merged (`merge_lora` is ignored): the released format holds
        no adapters; `export_ema` modules write their EMA weights. `module_folders`: modules that are one
        `PreTrainedModel` (LLaVA's `model.vision_tower`) also written as `<directory>/<module>/`, each loadable
        alone."""
        for name in module_folders or []:
            module_folder_root(model, name)  # refused before anything is written
        with ema_weights(model):  # `export_ema` modules: their EMA weights (a checkpoint's released copy too)
            export_original(model, directory, is_main_process, max_shard_size)
            if module_folders:
                export_module_folders(model, directory, list(module_folders), is_main_process, max_shard_size)
        if is_main_process:
            root_config(model).to_json_file(os.path.join(directory, ADOPTED_FILE))
            if model.released_step is not None:  # what the released class reads beyond its own save (speakers)
                model.released_step.save_files(directory)

    def write_root(self, model, directory: str) -> None:
        """A checkpoint's root `config.json` (its modules' folders beside it, keyed by the released names)."""
        root_config(model).save_pretrained(directory)

    def save_checkpoint(self, model, directory: str) -> None:
        """Its released format too, every rank its rows (what an export copies, a push uploads)."""
        model.save_pretrained(os.path.join(directory, RELEASED_FOLDER))

    # -- the Hub, the CLI -------------------------------------------------------------------------
    def check_push(self, args, model) -> None:
        if args.push_to_hub:  # one repo, the released format
            check_released_layout(args.hub_layout)

    def push(self, root: str, repo_id: str, *, layout=None, token=None, private=None, revision=None,
             commit_message: str = "Upload with hf_omni", extra_folders=None, cards: bool = True,
             **kwargs) -> dict[str, str]:
        return push_released(released_files(root), repo_id, layout=layout, token=token, private=private,
                             revision=revision, commit_message=commit_message, extra_folders=extra_folders,
                             cards=cards)

    def export_checkpoint(self, checkpoint: str, config, out: str) -> None:
        released = os.path.join(checkpoint, RELEASED_FOLDER)
        if not os.path.isfile(os.path.join(released, "config.json")):
            raise FileNotFoundError(f"{checkpoint} is an adopted model's checkpoint without its released/ folder")
        copy_module_folder(released, out)


def root_config(model) -> OmniConfig:
    """The mapping, the released class, each module's recorded source and, once prepared, whether it trained."""
    entries = [dataclasses.replace(s.entry, trained=s.trains if model.prepared is not None else s.entry.trained)
               for s in model.slots.values()]
    return OmniConfig(modules=entries, omni_class=type(model).__name__, adopted=model.config.adopted)


def adopt_empty(released_class, pretrained: str, modules: dict, processor=None, **kwargs) -> AdoptedModel:
    """The released model built as `from_pretrained` would build it (saved dtype, ties, keep-in-fp32 plan,
    generation config), on the meta device; every module pending on the released folder."""
    hub = {k: kwargs.pop(k, None) for k in ("revision", "token", "cache_dir")}
    if kwargs:
        raise TypeError(f"from_model(..., empty_init=True) takes no {sorted(kwargs)}: the module's dtype and "
                        "placement are its `modules:` settings")
    folder = pretrained
    if not os.path.isdir(folder) and is_hub_id(folder):
        folder = download_module(pretrained, hub["revision"], "(adopted model)", hub["token"], hub["cache_dir"])
    if not os.path.isfile(os.path.join(folder, "config.json")):
        raise FileNotFoundError(f"from_model: {pretrained} has no config.json: not a saved {released_class.__name__}")
    model = AdoptedModel.adopt(build_empty(released_class, folder), modules, processor=processor)
    for slot in model.slots.values():
        slot.pend(folder)
    return model

