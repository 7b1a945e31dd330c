"""Where a module's class comes from, and per-module loading options (`device_map`, `dtype`)."""

from __future__ import annotations

from transformers import PreTrainedModel

from .compat import registered_auto_classes
from .config import OmniConfig


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
