"""Test helpers that ship with hf_omni (its tests and quickstart notebook use them); nothing here is for real use."""

from .loopback_hub import LoopbackHub

__all__ = ["LoopbackHub"]
