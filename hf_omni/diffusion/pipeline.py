"""A diffusers pipeline adopted as downloaded: every `nn.Module` component is a module named as the component
(`unet`, `transformer`, `vae`, `text_encoder`, ...), each tokenizer the processor of its text encoder, and the rest
(scheduler, tokenizers, feature extractors) kept as the pipeline's parts (`model.pipeline_parts`; the scheduler also
as `model.scheduler`). The pipeline's `model_index.json` is recorded in the root config (`pipeline`), so a save
writes a pipeline folder back: `model_index.json`, the parts' folders and one folder per module in its library's own
format, which `PipelineClass.from_pretrained(folder)` loads."""

from __future__ import annotations

import inspect
import json
import os

from torch import nn

from ..files.empty_init import build_empty
from ..files.format import format_of
from ..formats.diffusers_models import diffusers_module, from_diffusers
from ..modules.ema import ema_weights, slot_emas
from .index import (
    INDEX,
    SAVED_BY,
    check_components,
    component_class,
    is_component,
    is_pipeline,
    pipeline_class,
    read_index,
)
from .lora_file import write_lora_file

NOTE = "PIPELINE.md"
NOTE_TEXT = ("# A training checkpoint of a {cls}\n\nNot a pipeline folder. Write one (components merged, LoRA also in "
             "diffusers' `pytorch_lora_weights.safetensors`) with:\n\n    hf-omni export <this folder> <out>\n\nthen "
             "`{cls}.from_pretrained(<out>)`.\n")


def from_pipeline(cls, pipeline, path=None, *, empty_init: bool = False, **kwargs):
    """`cls.from_pipeline(pipeline)` or `cls.from_pipeline(PipelineClass, folder_or_repo, empty_init=False,
    **from_pretrained_kwargs)`. `empty_init=True`: every module built on the meta device from its component folder
    and pending on it (`OmniPlugin.prepare` reads each rank's rows); the small parts are loaded whole."""
    if isinstance(pipeline, type):
        if path is None or not from_diffusers(pipeline):
            raise TypeError("from_pipeline(PipelineClass, path): a diffusers pipeline class and its folder or repo id")
        folder = str(path) if os.path.isdir(str(path)) else pipeline.download(str(path), **_hub(kwargs))
        check_components(folder, read_index(folder), given=kwargs)  # damage named before anything is built
        if empty_init:
            return _adopt_empty(cls, folder, kwargs)
        return _adopt(cls, pipeline.from_pretrained(folder, **kwargs), folder)
    if path is not None or empty_init or kwargs:
        raise TypeError("from_pipeline(pipeline) takes a pipeline instance alone (a class: from_pipeline(cls, path))")
    if not from_diffusers(type(pipeline)) or not hasattr(pipeline, "components"):
        raise ValueError(f"from_pipeline: expected a diffusers pipeline, got {type(pipeline).__name__}")
    root = str(pipeline.config.get("_name_or_path") or "")
    return _adopt(cls, pipeline, root if os.path.isdir(root) else None)


def _hub(kwargs: dict) -> dict:
    return {k: kwargs[k] for k in ("revision", "token", "cache_dir") if k in kwargs}


def _index(pipeline) -> dict:
    index = {k: list(v) if is_component(v) else v for k, v in dict(pipeline.config).items()}
    return {**{k: v for k, v in index.items() if k not in SAVED_BY}, "_class_name": type(pipeline).__name__}


def _adopt(cls, pipeline, folder: str | None):
    index, components = _index(pipeline), pipeline.components
    modules = {n: c for n, c in components.items() if isinstance(c, nn.Module)}
    parts = {n: c for n, c in components.items() if c is not None and n not in modules}
    return _compose(cls, index, modules, parts, folder)


def _adopt_empty(cls, folder: str, kwargs: dict):
    index = read_index(folder)
    for name in [k for k, v in kwargs.items() if v is None and is_component(index.get(k))]:
        index[name] = [None, None]  # `safety_checker=None`: left out, as the pipeline's own loading leaves it
        del kwargs[name]
    if set(kwargs) - {"revision", "token", "cache_dir"}:
        raise TypeError(f"from_pipeline(..., empty_init=True) takes no {sorted(kwargs)}: each module's dtype and "
                        "placement are its `modules:` settings (a component is left out with `<name>=None`)")
    modules, parts = {}, {}
    for name, value in index.items():
        if not is_component(value) or value[0] is None:
            continue
        found = component_class(*value, name)
        if issubclass(found, nn.Module):
            modules[name] = build_empty(found, os.path.join(folder, name))
        else:
            parts[name] = found.from_pretrained(os.path.join(folder, name))
    model = _compose(cls, index, modules, parts, folder)
    for name, slot in model.slots.items():
        slot.pend(os.path.join(folder, name))
    return model


def _compose(cls, index: dict, modules: dict, parts: dict, folder: str | None):
    """The composed model over the components: tokenizer `tokenizer_N` the processor of `text_encoder_N`."""
    for name, module in modules.items():
        format_of(module)  # a component of no known kind: refused naming it (diffusers' extra, say)
    processors = {n: parts[n.replace("text_encoder", "tokenizer")] for n in modules
                  if n.startswith("text_encoder") and n.replace("text_encoder", "tokenizer") in parts}
    sources = {n: os.path.abspath(os.path.join(folder, n)) for n in modules
               if folder is not None and format_of(modules[n]).is_folder(os.path.join(folder, n))}
    model = cls.from_modules(modules, processors=processors, sources=sources)
    for entry in model.config.modules:
        entry.source = sources.get(entry.name)  # never the pipeline's root (a module's own source path)
    model.config.pipeline = index
    attach_parts(model, parts)
    return model


def attach_parts(model, parts: dict) -> None:
    model.pipeline_parts = dict(parts)
    if "scheduler" in parts:
        model.scheduler = parts["scheduler"]


def load_parts(model, root: str) -> None:
    """`from_pretrained` of a saved pipeline: its parts back from their folders beside the modules."""
    index = getattr(model.config, "pipeline", None)
    if index is None:
        return
    parts = {}
    for name, value in index.items():
        if is_component(value) and value[0] is not None and name not in model.slots:
            parts[name] = component_class(*value, name).from_pretrained(os.path.join(root, name))
    attach_parts(model, parts)


def write_parts(model, directory: str) -> None:
    """The main process, with the root config: the parts' folders and, until `write_index` makes the folder a
    pipeline folder, `PIPELINE.md` saying how to get one (a checkpoint: its LoRA modules hold adapters beside their
    base weights and its frozen modules may live elsewhere, so diffusers must not load it as a pipeline)."""
    if not is_pipeline(model):
        return
    os.makedirs(directory, exist_ok=True)
    for name, part in model.pipeline_parts.items():
        part.save_pretrained(os.path.join(directory, name))
    with open(os.path.join(directory, NOTE), "w") as f:
        f.write(NOTE_TEXT.format(cls=model.config.pipeline["_class_name"]))


def write_adapters(model, directory: str, is_main_process: bool) -> None:
    """Every rank, after the modules' folders: a pipeline's LoRA in diffusers' own file (`lora_file`; the EMA
    weights of `export_ema` modules)."""
    with ema_weights(model):
        write_lora_file(model, directory, is_main_process)


def write_index(model, directory: str) -> None:
    """The main process, last: `model_index.json`, which makes `directory` a pipeline folder."""
    if not is_pipeline(model):
        return
    out = {**model.config.pipeline, "_diffusers_version": diffusers_module().__version__}
    with open(os.path.join(directory, INDEX), "w") as f:
        f.write(json.dumps(out, indent=2, sort_keys=True) + "\n")
    if os.path.exists(os.path.join(directory, NOTE)):
        os.remove(os.path.join(directory, NOTE))


def to_pipeline(model):
    """A live pipeline over the model's modules (as they are: wrapped, sharded, training) and parts."""
    index = getattr(model.config, "pipeline", None)
    if index is None:
        raise ValueError(f"{type(model).__name__} was not adopted from a pipeline (from_pipeline): no pipeline to "
                         "build")
    cls = pipeline_class(index)
    offline = [name for name, slot in model.slots.items() if slot.is_offline]
    if offline:
        raise ValueError(f"to_pipeline: modules {offline} are offline (cached, on the meta device): a pipeline runs "
                         "every component; sample with a model whose encoders are not offline")
    values = {k: (None if is_component(v) else v) for k, v in index.items() if not k.startswith("_")}
    values.update(model.pipeline_parts)
    values.update(model.omni_modules())
    accepted = inspect.signature(cls.__init__).parameters
    pipeline = cls(**{k: v for k, v in values.items() if k in accepted})
    # its record names each component's own class, not an in-place wrapper's (`DDPCLIPTextModel`); save through
    # the model (`save_pretrained`), which writes sharded modules whole: the live pipeline's own save cannot
    pipeline.register_to_config(**{k: tuple(v) for k, v in index.items() if is_component(v) and k in pipeline.config})
    if slot_emas(model, export_only=True):  # `export_ema`: each call samples with the EMA weights, swapped back after
        pipeline.__class__ = _sampling_with_ema(type(pipeline), model)
    return pipeline


def _sampling_with_ema(cls, model):
    """`cls` (same name) whose `__call__` runs inside `ema_weights(model)`."""
    def __call__(self, *args, **kwargs):
        with ema_weights(model):
            return cls.__call__(self, *args, **kwargs)

    return type(cls.__name__, (cls,), {"__call__": __call__, "__module__": cls.__module__})
