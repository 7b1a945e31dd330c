"""`Layout`: a way of splitting one module over ranks beyond data parallelism (tensor, expert parallelism, ...),
declared once in its own file, and its registry (`LAYOUTS`, by name: the `parallelism` key `<name>_size`).

A layout declares what it adds to a module's dimensions (`dims.ModuleDims` is built from these declarations; the
key tables, the refusals and the docs too): its size key, its mesh dim and where it sits (`dim`), what its size
must divide, the layouts it cannot share a module with, the strategies it composes under, why LoRA is refused
under it, and what its boundary with the rest of the composed model moves. At run time one instance per module
splits it before the strategy shards the rest (`apply`), shards first what it split on a mesh of its own
(`shard_first`), and installs its boundary after (`after_fsdp`). A new layout is one file with a `Layout` subclass
and `@register_layout`; nothing outside that file names its key."""

from __future__ import annotations

from torch import nn

from ..core.errors import OmniArgumentError
from ..core.registry import Registry
from ..modules.units import roots_of

ROLES = {
    "model": "innermost, after the data dims: the layout splits the module's tensors over it, FSDP2 shards the rest "
             "over the data dims",
    "replicate": "beside `dp_replicate`: a data dim FSDP2 replicates over (each rank its own batch)",
    "shard": "beside `dp_shard`: a data dim FSDP2 shards over too",
}


class _SizeKey:
    """`Layout.size_key`: `<name>_size`, the key of `parallelism` that sets it (Accelerate's field names)."""

    def __get__(self, obj, cls) -> str:
        return f"{cls.name}_size"


class Layout:
    """One layout of one module: the class declares it, an instance (per module) applies it."""

    name = ""  # its registry name, its mesh dim's name, and (+ `_size`) its key in `parallelism`
    description = ""  # one line, for messages and tables ("tensor parallelism")
    settings_class = None  # its settings are its size
    size_key = _SizeKey()
    dim: str | None = "model"  # where its mesh dim sits (`ROLES`), or None: no dim of the module's mesh (a mesh of
    # its own over the same ranks); then its size multiplies nothing and must divide the product of `divides`
    divides: tuple[str, ...] = ()  # size keys whose product its size divides (a layout without a dim)
    divides_why = ""  # the rule's reason, for its refusal
    multiple_of: tuple[str, ...] = ()  # size keys its size must be a multiple of (where set above 1)
    multiple_of_why = ""  # the rule's reason, for its refusal
    excludes: tuple[str, ...] = ()  # size keys it cannot share a module with
    strategies: tuple[str, ...] = ("fsdp",)  # the `parallel:` values it composes under
    lora: str | None = None  # why LoRA is refused under it (None: LoRA composes with it)
    lora_terms: str | None = None  # the terms LoRA composes on under it (for the docs' table)
    boundary: str | None = None  # what moves between the split module and the rest of the model (None: nothing)
    notes: dict[str, str] = {}  # a feature of docs/parallel.md's matrix (`FEATURES`) that no test serves under it:
    # "refused: why" (refused by name when asked) or "n/a: why" (the layout leaves it as FSDP2 does)

    def __init__(self, module_name: str, sizes: dict, meshes=None):
        self.module_name, self.sizes, self.meshes = module_name, sizes, meshes

    def size(self, key: str | None = None) -> int:
        """Its own size, or another key's size in the module's `parallelism` entry (1 where unset)."""
        return self.sizes.get(key or self.size_key, 1)

    def scoped(self, module: nn.Module, plan_of) -> tuple[nn.Module, dict]:
        """(the model a transformers plan applies to, its plan, `plan_of(model)`): the module itself, or for an
        adopted model's module the released model with the entries under the module's paths (its LLM's layers, its
        `lm_head`), not under a child carved out for another module."""
        roots = roots_of(module)
        model = getattr(module, "omni_released", None) if roots else module
        if model is None:
            return module, {}
        plan = plan_of(model)
        if roots:
            paths = [r.path for r in roots]
            carved = [f"{r.path}.{c}" for r in roots for c in r.carved]
            under = lambda key, tops: any(key == top or key.startswith(top + ".") for top in tops)  # noqa: E731
            plan = {k: v for k, v in plan.items() if under(k, paths) and not under(k, carved)}
        return model, plan

    @classmethod
    def lora_problem(cls, lora: dict) -> tuple[str, str] | None:
        """(the `lora` key, why) for a LoRA config it cannot serve although LoRA composes with it, else None."""
        return None

    def check(self, module: nn.Module) -> None:
        """Refuse, naming the module and `parallelism.<size_key>`, what it cannot split (before anything is)."""

    def apply(self, module: nn.Module, mesh) -> None:
        """Split `module` over `mesh[self.name]` (a layout with a dim), before the strategy shards the rest."""

    def shard_first(self, module: nn.Module, kwargs: dict) -> None:
        """Shard, on a mesh of its own, what it split before FSDP2's units over the data-parallel dims take the rest
        (`kwargs`: the module's `fully_shard` settings)."""

    def after_fsdp(self, module: nn.Module, mesh, methods: tuple[str, ...]) -> None:
        """What the rest of the composed model needs around the split module (its boundary), after FSDP2;
        `methods`: those other than `forward` a composed forward may call on it."""


FEATURES = ("LoRA", "EMA", "bf16, fp32 masters", "activation checkpointing", "accumulation", "HSDP",
            "elastic resume", "empty_init", "generate", "missing modality", "adopted model", "loss from labels",
            "tied embeddings", "diffusers denoiser", "the other layout")  # the matrix's columns (docs/parallel.md)


LAYOUTS = Registry("layout", Layout, identifiers=True, label="`parallelism.{name}_size`")


def register_layout(cls: type[Layout]) -> type[Layout]:
    """Make a `Layout` subclass a `parallelism` key (`<name>_size`), in the same shape as every `register_*`."""
    return LAYOUTS.register(cls)


def layouts_for(module_name: str, parallelism: dict | None, meshes=None) -> list[Layout]:
    """The layouts a module's `parallelism` entry asks for (a size above 1), in registry order; `meshes`: the run's
    `dims.Meshes` (where a layout builds a mesh of its own)."""
    sizes = parallelism or {}
    return [cls(module_name, sizes, meshes) for cls in LAYOUTS if sizes.get(cls.size_key, 1) > 1]


def layout_keys() -> tuple[str, ...]:
    """Every registered layout's size key."""
    return tuple(cls.size_key for cls in LAYOUTS)


def own_dims() -> set[str]:
    """The mesh dims that are a layout's own (`dim = "model"`): a tensor on them is split, not sharded by FSDP2."""
    return {cls.name for cls in LAYOUTS if cls.dim == "model"}


def asked(entry: dict | None) -> list[type[Layout]]:
    """The layouts a `parallelism` entry asks for (a size above 1)."""
    return [cls for cls in LAYOUTS if (entry or {}).get(cls.size_key, 1) > 1]


def refuse_at_top_level(entry: dict | None) -> None:
    """A layout is per module: the rest of the composed model is data parallel."""
    for cls in asked(entry):
        raise OmniArgumentError(None, f"parallelism.{cls.size_key}", f"{cls.description} is per module: set it under "
                                "modules.<name>.parallelism (the rest of the composed model is data parallel)")


def refuse_strategy(module: str, entry: dict | None, parallel: str) -> None:
    """Each layout an entry asks for composes under the strategies it declares."""
    for cls in asked(entry):
        if parallel not in cls.strategies:
            raise OmniArgumentError(module, f"parallelism.{cls.size_key}", f"{cls.description} is composed under "
                                    f"`parallel: {' | '.join(cls.strategies)}`: it needs `parallel: "
                                    f"{cls.strategies[0]}`; this module is `parallel: {parallel}`")


def refuse_lora(module: str, entry: dict | None, lora: dict | None = None) -> None:
    """LoRA on a module, under the layouts that declare why they refuse it or the `lora` settings they cannot
    serve."""
    for cls in asked(entry):
        if cls.lora:
            raise OmniArgumentError(module, f"parallelism.{cls.size_key}", f"LoRA under {cls.description} is not "
                                    f"supported ({cls.lora}): drop `lora` or `{cls.size_key}` for this module")
        problem = cls.lora_problem(lora or {})
        if problem is not None:
            raise OmniArgumentError(module, problem[0], f"under {cls.description} ({cls.size_key}): {problem[1]}")
