"""The interface every parallel strategy implements (`Strategy`), and its registry (`STRATEGIES`: `parallel:` values).

A strategy owns everything about one way of running a module across ranks: its settings (a dataclass of declared
keys, parsed once from the module's `settings_key` entry), its mesh's shape, applying it to one module in place (the
module keeps its class and methods), gradient sync inside accumulation windows, the dtype it computes in, where its
shards are read into, and the module's full state. It is then kept in that module's slot: the driver, the
checkpoint and the missing-modality exchange ask it, never its type. A new strategy is one file with a `Strategy`
subclass and one registration (`hf_omni.register_strategy`); nothing else names it.
"""

from __future__ import annotations

import torch
from torch import nn

from ..core.errors import OmniArgumentError
from ..core.keys import declared, default_of
from ..core.registry import Registry

MODEL_SCOPE = "(model)"  # the key of the one strategy over the composed model (`fsdp_scope: model`)
FORWARD_METHODS = ("generate", "get_image_features", "get_audio_features", "get_text_features",
                   "get_video_features", "encode", "decode")  # what a composed forward may call on a module besides
# `forward`: a strategy and a layout serve them too


def strategy_names() -> tuple[str, ...]:
    """The values `parallel:` accepts (read when a value is checked: strategies registered later count)."""
    return STRATEGIES.names()


def settings_owner(key: str) -> type["Strategy"] | None:
    """The registered strategy whose settings the per-module key `key` holds (`fsdp_plugin`: fsdp's)."""
    return next((cls for cls in STRATEGIES if cls.settings_key == key), None)


def settings_keys() -> set[str]:
    """The per-module keys that hold a registered strategy's settings."""
    return {cls.settings_key for cls in STRATEGIES if cls.settings_key}


def check_settings(module: str | None, key: str, values: dict) -> None:
    """Validate a strategy's settings entry as written (in an overlay, null removes an inherited setting)."""
    owner = settings_owner(key)
    if owner is not None and owner.settings_class is not None:
        owner.settings_class.check_overlay(module, values)


def settings_tables() -> list[str]:
    """docs/configuration.md's table of each registered strategy's settings keys (from their declarations)."""
    rows = []
    for cls in STRATEGIES:
        if cls.settings_class is not None:
            rows += ["", f"| `{cls.settings_key}` key (`parallel: {cls.name}`) | default | what it does |",
                     "|---|---|---|"]
            rows += [f"| `{name}` | `{default_of(f)!r}` | {f.metadata['help']} |"
                     for name, f in declared(cls.settings_class).items()]
    return rows


class Strategy:
    """How one module (or, under `fsdp_scope: model`, the composed model) runs across ranks."""

    name = ""
    description = ""  # one line, for the key tables
    settings_class: type | None = None  # its settings dataclass (keys declared with `core.keys.key`), or None
    settings_key: str | None = None  # the per-module key holding them (`fsdp_plugin`)
    collective = False  # its forward / backward runs collectives that every rank must enter
    shards = False  # its tensors are this rank's shares (DTensors): an `empty_init` module is read after `apply`
    takes_mesh = False  # `parallelism` gives it a device mesh (`mesh_shape`)
    sync_each_batch = False  # reduces gradients on every micro-step of a window (a module's `sync_each_batch` key)

    def __init__(self, module_name: str = "", settings=None, mesh=None):
        self.module_name, self.settings, self.mesh = module_name, settings, mesh

    @classmethod
    def parse_settings(cls, module: str | None, values: dict | None):
        """Its settings object from the entry as written (errors name the module and key); None without any."""
        if cls.settings_class is None:
            return None
        try:
            return cls.settings_class.from_dict(module, dict(values or {}))
        except TypeError as err:
            raise OmniArgumentError(module, cls.settings_key, str(err)) from None

    @classmethod
    def compute_dtype(cls, settings, run_dtype: torch.dtype | None) -> torch.dtype | None:
        """The dtype the module computes in under these settings (default: the run's)."""
        return run_dtype

    @classmethod
    def check_fp16(cls, module: str, settings) -> None:
        """Refuse, naming module and key, settings that fp16's shared loss scaler cannot serve."""

    @classmethod
    def for_module(cls, slot, mesh=None, lazy_init: bool = True, meshes=None) -> "Strategy":
        """The strategy for one module, from its slot's resolved arguments (`mesh`: its device mesh, if it takes
        one; `lazy_init=False`: it is on the meta device until read after wrapping; `meshes`: the run's `dims.Meshes`,
        where it builds any other mesh it needs on the same ranks)."""
        return cls(slot.name, slot.settings, mesh)

    @classmethod
    def for_model(cls, settings, mesh, compute: torch.dtype | None) -> "Strategy":
        """One strategy over the whole composed model (`fsdp_scope: model`)."""
        raise OmniArgumentError(None, "fsdp_scope", f"`parallel: {cls.name}` does not wrap the composed model")

    @property
    def key(self) -> str:
        """Its name in per-module views (`OmniPlugin.meshes`): the module's, or `(model)` for the composed model."""
        return self.module_name

    def reading_device(self, device: torch.device) -> torch.device:
        """Where an `empty_init` module's shares are allocated and read (default: where it computes)."""
        return device

    def apply(self, module: nn.Module, device: torch.device) -> None:
        """Wrap `module` in place (its class becomes a generated subclass; its methods keep working)."""

    def after_reading(self) -> None:
        """Called once every `empty_init` module was read into its shares (a sharding strategy's deferred init)."""

    def set_gradient_sync(self, enabled: bool) -> None:
        """Off inside a gradient-accumulation window; on for its last micro-step. A strategy whose
        `sync_each_batch` is true still reduces inside the window what keeps its gradients sharded."""

    def full_state_dict(self, module: nn.Module) -> dict[str, torch.Tensor]:
        """`module`'s full state dict (every rank calls this; a sharded one is gathered to rank 0 only, the other
        ranks getting `{}`)."""
        return module.state_dict()


STRATEGIES = Registry("strategy", Strategy, identifiers=True, label="`parallel: {name}`")


def register_strategy(name_or_cls, cls: type[Strategy] | None = None) -> type[Strategy]:
    """Make a `Strategy` subclass a `parallel:` value: `register_strategy(cls)` under its `name`,
    `register_strategy(name, cls)`, or `@register_strategy`. Returns the class. Values are checked against the
    registry when arguments are validated, so a name registered after `import hf_omni` is accepted."""
    return STRATEGIES.register(name_or_cls, cls)
