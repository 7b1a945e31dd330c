"""The plain composition (`OmniModel.from_modules`): named modules, a root `config.json` recording them (`OmniConfig`)
and one HF folder per module, each loadable alone; the kind every other builds on, and the one a root config with
no other kind's record is.

    out/config.json            module names in order; each one's class, subfolder, source, processor, Hub origin
    out/<module>/              its HF folder (config, weights, processor; a LoRA module's adapter beside its base)
"""

from __future__ import annotations

import dataclasses
import os

from ..checkpoint.ema_export import exports_ema, fill_ema_weights
from ..core.config import ModuleEntry, OmniConfig
from ..core.progress import each
from ..files.composition import Composition, composition_of, register_composition
from ..files.folder import (
    PROCESSOR_KINDS,
    copy_module_folder,
    export_module,
    load_module,
    load_processor,
    processor_kind,
)
from ..files.format import FORMATS, format_of, original_class, record_class, resolve_class
from ..files.module_folder import module_folder
from ..hub.download import download_composition, hub_origin, linked_folders
from ..hub.ids import is_hub_id
from ..hub.push import hub_modules, plan_modules, push_composition
from ..modeling import OmniModel


@register_composition
class PlainComposition(Composition):
    name = "plain"
    description = "named modules (`from_modules`): a root config.json and one HF folder per module"
    catch_all = True

    def holds(self, config) -> bool:
        return self.catch_all  # every root config no other kind holds (a subclass claims none unless it says so)

    def owns_saved(self, root: str) -> bool:
        return self.catch_all

    # -- building ---------------------------------------------------------------------------------
    def compose(self, cls, modules: dict, processors: dict | None = None, sources: dict | None = None):
        """`modules` (name -> a PreTrainedModel, or a module of a registered `ModuleFormat`); a module loaded from
        a local folder records it as its source (override with `sources`)."""
        processors, sources = dict(processors or {}), dict(sources or {})
        for name, module in modules.items():
            if not any(f.handles(original_class(module)) for f in FORMATS):
                raise ValueError(f"module {name!r}: expected a transformers PreTrainedModel or a module of a "
                                 f"registered ModuleFormat, got {type(module).__name__}")
        for name in list(processors) + list(sources):
            if name not in modules:
                raise ValueError(f"module {name!r} has a processor or source but is not a module: {list(modules)}")
        entries = []
        for name, module in modules.items():
            source, path = sources.get(name), format_of(module).source_path(module)
            if source is None and path and os.path.isdir(path):
                source = os.path.abspath(path)
            entries.append(ModuleEntry(name, record_class(original_class(module), name), name, source,
                                       **hub_origin(module)))
        return cls(OmniConfig(modules=entries, omni_class=cls.__name__), modules=modules, processors=processors)

    def load(self, cls, root: str, *, empty_init: bool = False, device_map=None, dtype=None,
             merge_lora: bool = False, revision=None, token=None, cache_dir=None, **kwargs):
        """Each module from its subfolder, or from its recorded source when the subfolder is absent; a repo id: the
        root config first, then exactly the module files it needs (`hub.download`)."""
        if is_hub_id(root):
            root, config, folders = download_composition(root, revision, token, cache_dir)
        elif not os.path.isfile(os.path.join(root, "config.json")):
            raise FileNotFoundError(f"{root} has no config.json: not a saved OmniModel folder")
        else:
            config = OmniConfig.from_pretrained(root)
            folders = linked_folders(root, config, token, cache_dir)
        for entry in config.modules:  # unknown until a run prepares this model again (a push then verifies links)
            entry.trained = None
        placement, dtypes = per_module(device_map, config, "device_map"), per_module(dtype, config, "dtype")
        if empty_init and (device_map is not None or dtype is not None or merge_lora):
            raise ValueError("from_pretrained: empty_init (training) takes no device_map, dtype or merge_lora")
        modules, processors, folder_of = {}, {}, {}
        for entry in config.modules:
            name = entry.name
            folder_of[name] = folder = folders.get(name) or module_folder(root, config, name)
            extra = {k: v for k, v in (("device_map", placement[name]), ("dtype", dtypes[name])) if v is not None}
            modules[name] = load_module(resolve_class(entry.cls, name), folder, empty_init, merge_lora,
                                        **kwargs, **extra)
            if entry.processor in PROCESSOR_KINDS:
                processors[name] = load_processor(folder, entry.processor)
        model = cls(config, modules=modules, processors=processors)
        composition_of(config).load_beside(model, root)
        if empty_init:
            for name, slot in model.slots.items():
                slot.pend(folder_of[name])
        return model if empty_init else model.eval()

    # -- saving -----------------------------------------------------------------------------------
    def save(self, model, directory: str, *, is_main_process: bool, merge_lora: bool, max_shard_size,
             **kwargs) -> None:
        if is_main_process:
            os.makedirs(directory, exist_ok=True)
        self.write_modules(model, directory, merge_lora, is_main_process, max_shard_size)
        if is_main_process:
            self.write_root(model, directory)

    def write_modules(self, model, directory: str, merge_lora: bool, is_main_process: bool, max_shard_size) -> None:
        """One HF folder per module (with its processor; its weights split into files of at most
        `max_shard_size`); an offline module (on the meta device) copied from its recorded source."""
        for slot in each(list(model.slots.values()), f"exporting to {directory}"):
            folder = os.path.join(directory, slot.entry.subfolder)
            if not slot.is_offline:
                export_module(slot, folder, merge_lora, is_main_process, max_shard_size)
                continue
            source = slot.entry.source
            if not source or not format_of(slot.module).is_folder(source):
                raise ValueError(f"module {slot.name!r} is on the meta device (offline) and has no source folder "
                                 f"to export it from ({source!r})")
            if is_main_process:
                copy_module_folder(source, folder)

    def write_root(self, model, directory: str) -> None:
        """The root `config.json`: module names in order, each one's original class, subfolder, source and
        processor kind; once a run prepared the model, whether each was trained."""
        entries = [dataclasses.replace(slot.entry, cls=record_class(original_class(slot.module), slot.name),
                                       processor=processor_kind(slot.processor) if slot.processor is not None else None,
                                       trained=slot.trains if model.prepared is not None else slot.entry.trained)
                   for slot in model.slots.values()]
        OmniConfig(modules=entries, omni_class=original_class(model).__name__,
                   **self.config_record(model)).save_pretrained(directory)

    # -- the Hub, the CLI -------------------------------------------------------------------------
    def check_push(self, args, model) -> None:
        if args.push_to_hub:
            plan_modules(None, model.config, args.hub_model_id or "unnamed", args.hub_layout or "per_module",
                         hub_modules(args))

    def push(self, root: str, repo_id: str, **kwargs) -> dict[str, str]:
        return push_composition(root, repo_id, **kwargs)

    def export_checkpoint(self, checkpoint: str, config, out: str) -> None:
        """Each module's HF files copied; with `export_ema` modules, the model loaded and saved with their EMA
        weights (read from `state/`)."""
        if exports_ema(checkpoint, config):
            model_from(checkpoint, config).save_pretrained(out)
            return
        for name in each(config.module_names, f"exporting {checkpoint}"):
            copy_module_folder(module_folder(checkpoint, config, name),
                               os.path.join(out, config.module_entry(name).subfolder))
        config.save_pretrained(out)


def model_from(checkpoint: str, config):
    """The composed model of a checkpoint, loaded whole, its `export_ema` modules' EMA weights filled in."""
    model = OmniModel.from_pretrained(checkpoint)
    fill_ema_weights(model, checkpoint, config)
    return model


def per_module(value, config: OmniConfig, key: str) -> dict:
    """`value` for every module: one for all, or a `{module: value}` mapping naming modules of `config`."""
    if not isinstance(value, dict):
        return {name: value for name in config.module_names}
    unknown = sorted(set(value) - set(config.module_names))
    if unknown:
        raise ValueError(f"from_pretrained: {key} names {unknown}, not modules of this model {config.module_names}")
    return {name: value.get(name) for name in config.module_names}
