"""Where a module's class comes from (by name, never remote code; under an in-place wrapper), what transformers
saves a wrapped module as, and per-module loading options (`device_map`, `dtype`)."""

from __future__ import annotations

import weakref

import torch
from torch import nn
from transformers import PreTrainedModel

from .compat import in_place_wrapper_classes, registered_auto_classes
from .config import OmniConfig

SAVE_VIEWS: "weakref.WeakKeyDictionary[nn.Module, nn.Module]" = weakref.WeakKeyDictionary()


def original_class(module: nn.Module) -> type:
    """The module's own class, under any in-place wrapper subclass (`FSDPLlama...`, `DDPLlama...`)."""
    wrappers = in_place_wrapper_classes()
    cls = type(module)
    while len(cls.__bases__) == 2 and cls.__bases__[0] in wrappers:
        cls = cls.__bases__[1]
    return cls


def save_view(module: nn.Module) -> nn.Module:
    """What transformers' `save_pretrained` is called on: the module, or — wrapped in place (`FSDPViTModel`) — a
    meta-device model of its original class, config and dtype. Transformers looks its save-time key conversion
    (ViT's renaming) up by class name: on the wrapped class it would write another layout than an unwrapped save,
    and the folder would not load elsewhere."""
    import copy

    from accelerate import init_empty_weights

    cls = original_class(module)
    if type(module) is cls:
        return module
    if module not in SAVE_VIEWS:
        dtype = next((p.dtype for p in module.parameters() if p.is_floating_point()), torch.get_default_dtype())
        previous = torch.get_default_dtype()
        try:
            torch.set_default_dtype(dtype)
            with init_empty_weights(include_buffers=True):
                view = cls(copy.deepcopy(module.config))
        finally:
            torch.set_default_dtype(previous)
        if getattr(module, "generation_config", None) is not None:
            view.generation_config = copy.deepcopy(module.generation_config)
        SAVE_VIEWS[module] = view
    return SAVE_VIEWS[module]



def resolve_module_class(class_name: str, module: str) -> type[PreTrainedModel]:
    """Find a module class by name among transformers, hf_omni and the Auto classes' registered models.

    Never imports arbitrary code named in a config (that would be `trust_remote_code` by the back door).
    """
    import transformers

    import hf_omni

    candidates = [getattr(transformers, class_name, None), getattr(hf_omni, class_name, None)]
    candidates += [c for c in registered_auto_classes() if getattr(c, "__name__", None) == class_name]
    for cls in candidates:
        if isinstance(cls, type) and issubclass(cls, PreTrainedModel):
            return cls
    raise ValueError(
        f"module {module!r}: class {class_name!r} is neither a transformers / hf_omni model nor registered with "
        "an Auto class (register custom models with AutoModel.register)"
    )


def per_module(value, config: OmniConfig, key: str) -> dict:
    """`value` for every module: one for all, or a `{module: value}` mapping naming modules of `config`."""
    if not isinstance(value, dict):
        return {name: value for name in config.module_names}
    unknown = sorted(set(value) - set(config.module_names))
    if unknown:
        raise ValueError(f"from_pretrained: {key} names {unknown}, not modules of this model {config.module_names}")
    return {name: value.get(name) for name in config.module_names}
