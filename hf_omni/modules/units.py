"""A module made of another model's submodules (an adopted model's module), as the strategies see it: the roots
they wrap, each less the carved-out children that belong to another module.

The adopted model's `Part` subclasses `RootedModule`; strategies, activation checkpointing and the profile ask this
interface, not the adopted model, so `parallel/` does not import `adopt/`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn


@dataclass
class Root:
    """A path of a module: the released submodule there (what a strategy wraps) and the parameters under it that
    belong to carved-out modules (a wrap leaves them to theirs)."""

    path: str
    module: nn.Module
    carved: list[str] = field(default_factory=list)  # paths, relative to this one

    @property
    def depth(self) -> int:
        return self.path.count(".") + 1

    def carved_params(self) -> set:
        return {p for c in self.carved for p in self.module.get_submodule(c).parameters()}

    def carved_modules(self) -> list[nn.Module]:
        return [self.module.get_submodule(c) for c in self.carved]


class RootedModule(nn.Module):
    """A module that is never called itself: the submodules at its roots run inside another model's forward."""

    def __init__(self):
        super().__init__()
        self.omni_roots: list[Root] = []  # its paths that name submodules
        self.omni_tensors: list = []  # ... and those that name one parameter or buffer (`loose_tensors`)


def roots_of(module: nn.Module) -> list[Root]:
    """A rooted module's roots; none for a module that runs itself."""
    return module.omni_roots if isinstance(module, RootedModule) else []


def loose_tensors(module: nn.Module) -> list:
    """A rooted module's paths that name one tensor (each with a `.tensor` and its `.holder` submodule)."""
    return module.omni_tensors if isinstance(module, RootedModule) else []


def run_roots(module: nn.Module) -> list[nn.Module]:
    """What runs of a module: a rooted module's root submodules, or the module itself."""
    return [r.module for r in module.omni_roots] if isinstance(module, RootedModule) else [module]
