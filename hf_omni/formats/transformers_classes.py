"""The transformers format's classes (`formats.transformers`): a module class recorded by name and found again,
never by importing code from elsewhere (`register_module_class` for classes of your own), and what transformers'
`save_pretrained` is called on for a module wrapped in place (`save_view`)."""

from __future__ import annotations

import importlib
import re
import weakref

from torch import nn
from transformers import PreTrainedModel

from ..compat import registered_auto_classes
from ..files.format import original_class
from ..files.meta import meta_build

SAVE_VIEWS: "weakref.WeakKeyDictionary[nn.Module, nn.Module]" = weakref.WeakKeyDictionary()


def save_view(module: nn.Module) -> nn.Module:
    """What transformers' `save_pretrained` is called on: the module, or — wrapped in place (`FSDPViTModel`) — a
    meta-device model of its original class, config and dtype. Transformers looks its save-time key conversion
    (ViT's renaming) up by class name: on the wrapped class it would write another layout than an unwrapped save,
    and the folder would not load elsewhere."""
    import copy

    cls = original_class(module)
    if type(module) is cls:
        return module
    if module not in SAVE_VIEWS:
        dtype = next((p.dtype for p in module.parameters() if p.is_floating_point()), None)
        view = meta_build(cls, copy.deepcopy(module.config), dtype, include_buffers=True)
        if getattr(module, "generation_config", None) is not None:
            view.generation_config = copy.deepcopy(module.generation_config)
        SAVE_VIEWS[module] = view
    return SAVE_VIEWS[module]



REGISTERED: dict[str, type[PreTrainedModel]] = {}  # `register_module_class`: name -> class


def register_module_class(cls: type[PreTrainedModel]) -> type[PreTrainedModel]:
    """Make a model class of your own a valid module class (usable as a decorator): `from_pretrained` of a composed
    model finds it by name. Classes of transformers and classes registered with an Auto class need no this."""
    if not (isinstance(cls, type) and issubclass(cls, PreTrainedModel)):
        raise TypeError(f"register_module_class takes a PreTrainedModel subclass, got {cls!r}")
    known = REGISTERED.get(cls.__name__)
    if known is not None and known is not cls:
        raise ValueError(f"another class named {cls.__name__!r} is registered already ({known.__module__})")
    REGISTERED[cls.__name__] = cls
    return cls


def class_record(cls: type, module: str) -> str:
    """How a module's class is recorded so that its export can be built back: its name when transformers exports
    it at the top level, hf_omni registers it, or an Auto class has it registered; its module path inside the
    `transformers` package when transformers defines it deeper (`WhisperEncoder`). Anything else is refused here,
    at composition, rather than at reload after training."""
    import transformers

    name = cls.__name__
    if getattr(transformers, name, None) is cls or REGISTERED.get(name) is cls or cls in registered_auto_classes():
        return name
    if cls.__module__.startswith("transformers.models.") and getattr(
            importlib.import_module(cls.__module__), name, None) is cls:
        return f"{cls.__module__}.{name}"
    raise ValueError(
        f"module {module!r}: class {name} (from {cls.__module__}) cannot be found again when the saved model is "
        f"loaded: register it first with hf_omni.register_module_class({name}) (or AutoModel.register(its config "
        "class, it)), before from_modules and in every script that loads the model")


def resolve_module_class(record: str, module: str) -> type[PreTrainedModel]:
    """The class `class_record` recorded (`find_module_class`), or a clear error naming `module`."""
    cls = find_module_class(record)
    if cls is None:
        raise ValueError(
            f"module {module!r}: class {record!r} is neither a transformers / hf_omni model, nor registered with "
            "hf_omni.register_module_class or an Auto class (register your own classes before loading)")
    return cls


def find_module_class(record: str) -> type[PreTrainedModel] | None:
    """The class `class_record` recorded: by name among transformers, hf_omni, `register_module_class` and the Auto
    classes' registered models, or by module path inside the `transformers` package; None when none. Never imports
    code from anywhere else (that would be `trust_remote_code` by the back door)."""
    import transformers

    candidates = []
    if "." in record:
        path, _, name = record.rpartition(".")
        if _TRANSFORMERS_MODULE.fullmatch(path):
            try:
                candidates.append(getattr(importlib.import_module(path), name, None))
            except ImportError:
                pass  # not in the installed transformers: the caller's error names the record
    else:
        candidates += [getattr(transformers, record, None), REGISTERED.get(record)]
        candidates += [c for c in registered_auto_classes() if getattr(c, "__name__", None) == record]
    return next((c for c in candidates if isinstance(c, type) and issubclass(c, PreTrainedModel)), None)


_TRANSFORMERS_MODULE = re.compile(r"transformers\.models\.[a-z0-9_]+\.modeling_[a-z0-9_]+")
