"""A pipeline's `model_index.json` as the root config records it (`pipeline`): its class, its components
(`[library, class]` each) and its own settings (`requires_safety_checker`, ...), and the classes found from it."""

from __future__ import annotations

import importlib
import json
import os
import re

from torch import nn

from ..core.errors import DamagedFileError
from ..formats.diffusers_models import diffusers_module

INDEX = "model_index.json"
SAVED_BY = ("_name_or_path", "_diffusers_version")


def read_index(folder: str) -> dict:
    """A pipeline folder's `model_index.json`, its saving bookkeeping left out; a clear error naming the file where
    it is missing or not a JSON object."""
    path = os.path.join(folder, INDEX)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{folder} has no {INDEX}: not a diffusers pipeline folder")
    try:
        with open(path) as f:
            index = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise DamagedFileError(path, f"{path} is not valid JSON ({err}): restore the pipeline's {INDEX}") from None
    if not isinstance(index, dict) or not isinstance(index.get("_class_name"), str):
        raise DamagedFileError(path, f"{path} is not a pipeline's {INDEX} (no `_class_name`)")
    return {k: v for k, v in index.items() if k not in SAVED_BY}


def check_components(folder: str, index: dict, given=()) -> None:
    """Every component `model_index.json` names (but those `given` in its place) has its folder with its files in
    `folder`, before anything is built or read: a clear error naming the component and the folder otherwise."""
    for name, value in index.items():
        if not is_component(value) or value[0] is None or name in given:
            continue
        where = os.path.join(folder, name)
        if not os.path.isdir(where) or not os.listdir(where):
            raise FileNotFoundError(f"pipeline component {name!r}: {where} is missing or empty ({INDEX} names "
                                    f"{value[0]}.{value[1]} there)")
        module = issubclass(component_class(*value, name), nn.Module)
        if module and not os.path.isfile(os.path.join(where, "config.json")):
            raise FileNotFoundError(f"pipeline component {name!r}: {where} has no config.json")


def is_pipeline(model) -> bool:
    """Whether the composed model was adopted from a diffusers pipeline (its saves are pipeline folders)."""
    return bool(getattr(model.config, "pipeline", None))


def is_component(value) -> bool:
    """A `model_index.json` entry that names a component (`[library, class]`, `[null, null]` for none)."""
    return isinstance(value, (list, tuple)) and len(value) == 2


def component_class(library: str, name: str, component: str) -> type:
    """The class `model_index.json` records for a component (`library`: transformers, diffusers, or a diffusers
    pipeline module such as `stable_diffusion`)."""
    if not re.fullmatch(r"[a-z0-9_]+", str(library)):
        raise ValueError(f"pipeline component {component!r}: library {library!r} is not transformers, diffusers or a "
                         "diffusers pipeline module (no code is imported from elsewhere)")
    paths = (library,) if library in ("transformers", "diffusers") else (f"diffusers.pipelines.{library}",)
    for path in paths:
        try:
            found = getattr(importlib.import_module(path), name, None)
        except ImportError:
            continue
        if isinstance(found, type):
            return found
    raise ValueError(f"pipeline component {component!r}: class {library}.{name} was not found")


def pipeline_class(index: dict) -> type:
    name = index["_class_name"]
    found = getattr(diffusers_module(needed_by=f"pipeline {name}"), name, None)
    if not isinstance(found, type):
        raise ValueError(f"pipeline class {name!r} is not a diffusers pipeline class")
    return found


def part_names(config) -> list[str]:
    """The parts' folder names of a saved pipeline (what an export copies beside the modules)."""
    index = getattr(config, "pipeline", None) or {}
    names = set(config.module_names)
    return [n for n, v in index.items() if is_component(v) and v[0] is not None and n not in names]
