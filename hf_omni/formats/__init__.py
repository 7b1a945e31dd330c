"""The module formats hf_omni ships (`files.format.ModuleFormat`): a transformers `PreTrainedModel`
(`transformers`, its classes recorded by name in `transformers_classes`) and a diffusers `ModelMixin`
(`diffusers_models`); the adopted part's format is `adopt/format.py`. `hf_omni/__init__.py` registers them."""

from ..files.format import ModuleFormat, format_of, register_module_format

__all__ = ["ModuleFormat", "format_of", "register_module_format"]
