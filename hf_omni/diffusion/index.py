"""A pipeline's `model_index.json` as the root config records it (`pipeline`): its class, its components
(`[library, class]` each) and its own settings (`requires_safety_checker`, ...), and the classes found from it."""

from __future__ import annotations

import importlib
import re

from ..formats.diffusers_models import diffusers_module

INDEX = "model_index.json"
SAVED_BY = ("_name_or_path", "_diffusers_version")
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
