"""Kinds of modules (`ModuleFormat`) and their registry (`interface`: what a format is, `format_of`), and the
transformers format (`pretrained`: a `PreTrainedModel`); the adopted part's format is `adopt/format.py`. Both are
registered by `hf_omni/__init__.py`, the adopted part first."""

from ..files.format import ModuleFormat, format_of, register_module_format

__all__ = ["ModuleFormat", "format_of", "register_module_format"]
