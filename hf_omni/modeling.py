"""`OmniModel`: a composed model of named Hugging Face sub-models (modules).

Subclass it and write `forward`; each module is an attribute named by its key::

    class Captioner(OmniModel):
        def forward(self, pixel_values, input_ids, labels=None, **kw):
            prefix = self.projector(self.vision(pixel_values=pixel_values).last_hidden_state)
            embeds = torch.cat([prefix, self.llm.get_input_embeddings()(input_ids)], dim=1)
            return self.llm(inputs_embeds=embeds, labels=labels, **kw)

    model = Captioner.from_modules({"vision": vit, "projector": proj, "llm": lm}, processors={"llm": tok})
    model.save_pretrained("out")        # out/config.json + out/<module>/ (each loads alone)
    Captioner.from_pretrained("out")

Loss normalisation: Trainer passes `num_items_in_batch` to a `forward` with `**kw` and counts it from the instance's
`loss_type`. `label_shift = False` (default) counts every label that is not -100 (right when the forward prepends -100
labels and lets the LLM shift); `True` counts `labels[..., 1:]` (a forward that hands its labels straight to a causal
LM). A forward that drops `**kw` gets its loss scaled by world size x accumulation steps.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import tempfile
from typing import Any

from torch import nn
from transformers import PreTrainedModel

from .core.config import ModuleEntry, OmniConfig
from .core.dist import is_main
from .core.progress import each
from .diffusion import pipeline as pipeline_io
from .files.folder import (
    PROCESSOR_KINDS,
    copy_module_folder,
    export_module,
    load_module,
    load_processor,
    processor_kind,
)
from .files.format import FORMATS, adopter, format_of, original_class, record_class, resolve_class
from .files.module_folder import module_folder
from .formats.transformers_classes import model_input_embeddings, per_module
from .hub.download import download_composition, hub_origin, linked_folders
from .hub.ids import is_hub_id
from .hub.push import push_saved
from .model_hooks import ModelHooks
from .modules.slot import ModuleSlot
from .offline.missing_modality import before_forward, keep_in_graph


class OmniModel(ModelHooks, PreTrainedModel):
    """A composed model. Modules are attributes; `config` is an `OmniConfig` recording them; `slots[name]` is what
    is kept about each (`modules.slot.ModuleSlot`)."""

    config_class = OmniConfig
    base_model_prefix = "omni"
    main_input_name = "input_ids"
    label_shift: bool = False
    input_embeddings_module: str | None = None  # the module whose token embeddings are the model's (NEFTune)

    def __init__(self, config: OmniConfig, modules: dict[str, nn.Module] | None = None,
                 processors: dict[str, Any] | None = None):
        super().__init__(config)
        modules, processors = dict(modules or {}), dict(processors or {})
        missing = [n for n in config.module_names if n not in modules]
        if missing:
            raise ValueError(f"OmniModel: modules {missing} are in the config but were not given")
        for name in config.module_names:
            if hasattr(type(self), name) or name in dict(self.named_children()):
                raise ValueError(f"module {name!r}: the name clashes with an attribute of {type(self).__name__}")
            setattr(self, name, modules[name])
        self.slots = {e.name: ModuleSlot(e, modules[e.name], processors.get(e.name)) for e in config.modules}
        self._num_parameters: dict[bool, int] = {}
        self.prepared = None  # set by `OmniPlugin.prepare_modules`: `parallel.driver.Prepared`
        self.loss_type = "ForCausalLM" if self.label_shift else None
        self.register_forward_pre_hook(before_forward, with_kwargs=True)  # missing_modality.py: ranks
        self.register_forward_hook(keep_in_graph)  # whose batch lacks a module's input run it on a dummy

    # -- construction ---------------------------------------------------------------------------
    @classmethod
    def from_modules(cls, modules: dict[str, nn.Module], processors: dict[str, Any] | None = None,
                     sources: dict[str, str] | None = None) -> "OmniModel":
        """Compose `modules` (name -> a PreTrainedModel, or a module of a registered `ModuleFormat`). A module
        loaded from a local folder records it as its source (override with `sources`)."""
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

    @classmethod
    def from_model(cls, model, pretrained=None, *, modules: dict, processor=None, **kwargs) -> "OmniModel":
        """Adopt a released composite model as it is, `modules` mapping names to attribute paths (`hf_omni.adopt`,
        through the adopted part's format: `adopt.format`)."""
        return adopter().adopt(model, pretrained, modules=modules, processor=processor, **kwargs)

    @property
    def module_names(self) -> list[str]:
        return self.config.module_names

    def forward_owner(self) -> nn.Module:
        """The model whose class's `forward` Trainer reads label names from (an adopted model's: the released one)."""
        return self

    def omni_modules(self) -> dict[str, nn.Module]:
        return {name: slot.module for name, slot in self.slots.items()}

    @property
    def processors(self) -> dict[str, Any]:
        return {name: slot.processor for name, slot in self.slots.items() if slot.processor is not None}

    def floating_point_ops(self, input_dict, exclude_embeddings: bool = True) -> int:
        """Trainer calls this every step: 6 x tokens x parameters, with the parameter count cached."""
        if exclude_embeddings not in self._num_parameters:
            self._num_parameters[exclude_embeddings] = self.num_parameters(exclude_embeddings=exclude_embeddings)
        return 6 * self.estimate_tokens(input_dict) * self._num_parameters[exclude_embeddings]

    def get_input_embeddings(self) -> nn.Module:
        return model_input_embeddings(self)  # of `input_embeddings_module`, or of the one module that has them

    @classmethod
    def from_pipeline(cls, pipeline, path=None, **kwargs) -> "OmniModel":
        """Adopt a diffusers pipeline (`diffusion.pipeline`); saved back as a pipeline folder."""
        return pipeline_io.from_pipeline(cls, pipeline, path, **kwargs)

    def to_pipeline(self):
        """A live diffusers pipeline over the modules as they are (sampling during and after training)."""
        return pipeline_io.to_pipeline(self)

    # -- training-mode handling -----------------------------------------------------------------
    def train(self, mode: bool = True):
        """Once prepared, fully frozen modules stay in eval mode (their output is a pure function of their input)."""
        super().train(mode)
        for slot in self.slots.values() if self.prepared is not None else ():
            if not slot.trains:
                slot.module.eval()
        return self

    def no_sync(self):
        """Skip gradient sync in every wrapped unit (Accelerate's `no_sync(model)` calls this)."""
        return self.prepared.no_sync() if self.prepared is not None else contextlib.nullcontext()

    # -- save / load ----------------------------------------------------------------------------
    def save_pretrained(self, save_directory: str | os.PathLike, is_main_process: bool = True,
                        merge_lora: bool = False, max_shard_size: str | int = "50GB", **kwargs) -> None:
        """Write `config.json` (OmniConfig) and one HF folder per module (with its processor; its weights split into
        files of at most `max_shard_size`, as transformers does). With sharded modules every rank must call it: each
        writes its own rows of their files in place (`merge_lora`: a LoRA module is gathered and merged on the main
        process); other modules, and the small files, are written by `is_main_process` (under a process group: only
        if it is global rank 0, so that a call on every rank without `is_main_process` does not race)."""
        if kwargs.get("state_dict") is not None:
            raise ValueError("OmniModel.save_pretrained writes each module's own state; `state_dict=` is not supported")
        save_directory, is_main_process = str(save_directory), is_main_process and is_main()
        merge_lora = merge_lora or pipeline_io.is_pipeline(self)  # a pipeline folder holds merged components
        if is_main_process:
            os.makedirs(save_directory, exist_ok=True)
        for slot in each(list(self.slots.values()), f"exporting to {save_directory}"):
            folder = os.path.join(save_directory, slot.entry.subfolder)
            if slot.is_offline:  # offline: on the meta device, its files copied from its recorded source
                source = slot.entry.source
                if not source or not format_of(slot.module).is_folder(source):
                    raise ValueError(f"module {slot.name!r} is on the meta device (offline) and has no source folder "
                                     f"to export it from ({source!r})")
                if is_main_process:
                    copy_module_folder(source, folder)
                continue
            export_module(slot, folder, merge_lora, is_main_process, max_shard_size)
        pipeline_io.write_adapters(self, save_directory, is_main_process)  # a pipeline's LoRA: diffusers' file
        if is_main_process:
            self.write_config(save_directory)
            pipeline_io.write_index(self, save_directory)

    def write_config(self, directory: str) -> None:
        """The root `config.json`: module names in order, each one's original class, subfolder, source and
        processor kind; once a run prepared the model, whether each was trained."""
        entries = [dataclasses.replace(slot.entry, cls=record_class(original_class(slot.module), slot.name),
                                       processor=processor_kind(slot.processor) if slot.processor is not None else None,
                                       trained=slot.trains if self.prepared is not None else slot.entry.trained)
                   for slot in self.slots.values()]
        OmniConfig(modules=entries, omni_class=original_class(self).__name__,
                   **pipeline_io.config_record(self)).save_pretrained(directory)
        pipeline_io.write_parts(self, directory)

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path: str | os.PathLike, *args, empty_init: bool = False,
                        device_map=None, dtype=None, merge_lora: bool = False, **kwargs) -> "OmniModel":
        """Rebuild the composed model from `save_pretrained` output (each module from its subfolder, or from its
        recorded source when the subfolder is absent; an adopted model's folder: `adopt.model`). The eager build (one
        process, no process group; eval mode): `device_map` a device, `"auto"` (each module placed by transformers /
        Accelerate) or `{module: device}`; `dtype` one for all or `{module: dtype}`; LoRA modules keep their adapters
        unless `merge_lora=True` (merged by PEFT into plain weights). `empty_init=True` (training): modules are built
        on the meta device and remember their weights folder; `OmniPlugin.prepare` shards them first and reads each
        rank's shards after (see `hf_omni.files.weights`)."""
        if args:
            raise TypeError("OmniModel.from_pretrained takes the folder or repo id and keyword arguments only")
        root = str(pretrained_model_name_or_path)
        hub = {k: kwargs.pop(k, None) for k in ("revision", "token", "cache_dir")}
        whole = next((f for f in FORMATS if f.holds_model(root, **hub)), None)  # an adopted model (`adopt.format`)
        if whole is not None:  # in its released format (a folder or a repo)
            return whole.load_model(root, **hub, **kwargs)
        if is_hub_id(root):  # a composition repo: its config, then exactly the module files it needs
            root, config, folders = download_composition(root, **hub)
        elif not os.path.isfile(os.path.join(root, "config.json")):
            raise FileNotFoundError(f"{root} has no config.json: not a saved OmniModel folder")
        else:
            config = OmniConfig.from_pretrained(root)
            folders = linked_folders(root, config, hub["token"], hub["cache_dir"])
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
        pipeline_io.load_parts(model, root)
        if empty_init:
            for name, slot in model.slots.items():
                slot.pend(folder_of[name])
        return model if empty_init else model.eval()

    def push_to_hub(self, repo_id: str, *, hub_layout: str | None = None, modules: dict | None = None,
                    token: str | None = None, private: bool | None = None, revision: str | None = None,
                    commit_message: str = "Upload with hf_omni", merge_lora: bool = False,
                    is_main_process: bool = True) -> dict[str, str] | None:
        """Save to a temporary folder and push it (`hub.push.push_saved`): per-module repos plus the composition repo
        `repo_id` (`hub_layout: per_module`), or one repo (`single`). `modules`: `{name: {push_to_hub, hub_model_id}}`.
        With sharded modules every rank calls it; the main process pushes. Returns `{repo: commit}`."""
        with tempfile.TemporaryDirectory(prefix="hf_omni_push_") as tmp:
            self.save_pretrained(tmp, is_main_process=is_main_process, merge_lora=merge_lora)
            if not is_main_process:
                return None
            return push_saved(tmp, repo_id, layout=hub_layout, modules=modules, token=token, private=private,
                              revision=revision, commit_message=commit_message)
