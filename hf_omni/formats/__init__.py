"""Kinds of modules (`ModuleFormat`) and their registry (`interface`: what a format is, `format_of`), and the shipped
formats: `part` (an adopted model's module) and `pretrained` (a transformers `PreTrainedModel`), registered in that
order by `hf_omni/__init__.py`."""

from .interface import ModuleFormat, format_of, register_module_format

__all__ = ["ModuleFormat", "format_of", "register_module_format"]
