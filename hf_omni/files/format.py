"""`ModuleFormat`: everything about one kind of module (a transformers `PreTrainedModel`, an adopted model's part, a
kind of your own), and the registry of formats every other file asks (`format_of`).

A kind of module is one `ModuleFormat` subclass plus `hf_omni.register_module_format(TheFormat)`: how a class is
told to be of the kind (`handles`), its class record in the root config and the class found again from it, its
folder's file names, building on the meta device as its library's loading builds it, loading a folder whole,
writing the folder's non-weight files, the save-time key conversion, its model card's fields and whether a Hub
repo at a commit rebuilds it. The weights (safetensors, one file or shards with an index, every rank its rows),
LoRA adapters, processors and checkpoints stay generic. Formats are consulted in order (`core.registry`): those
registered from outside first (the latest first), then hf_omni's own (`adopt.format`, `formats.transformers`,
`formats.diffusers_models`, registered in that order by `hf_omni/__init__.py`).
"""

from __future__ import annotations

import os

from torch import nn

from ..compat import in_place_wrapper_classes
from ..core.registry import Registry


class ModuleFormat:
    """A kind of module. Subclass it, set the file names, write the methods that raise here; the defaults are those
    of a module with no save-time key conversion and no Hub link check."""

    name = "module"  # a short name, for messages (its registry name: the class's own `name`, else its qualname)
    description = ""  # one line, for the docs
    settings_class = None  # a format takes no settings
    config_files: tuple[str, ...] = ("config.json",)  # its folder's config file(s); the first marks a module folder
    other_files: tuple[str, ...] = ()  # more non-weight files its folder may hold (patterns, copied with it)
    weights_pattern = "model{suffix}.safetensors"  # the weights file ({suffix}: "" or a shard's "-00001-of-00002")
    weights_index = "model.safetensors.index.json"  # the index of sharded weights
    library_name: str | None = None  # the model card's `library_name`
    exported = True  # its folders are an export's (copied, pushed, downloaded); False: a checkpoint's only

    @property
    def weights_file(self) -> str:
        return self.weights_pattern.format(suffix="")

    def handles(self, cls: type) -> bool:
        """Whether module class `cls` (never a wrapper subclass) is of this kind."""
        raise NotImplementedError

    def class_record(self, cls: type, module: str) -> str:
        """What the root config records of the class (`"class"`), so that `resolve` finds it again; a clear error
        (naming `module`) when it could not be found again at load time."""
        return cls.__name__

    def resolve(self, record: str) -> type | None:
        """The class `class_record` recorded, or None when this format does not know the record."""
        return None

    def is_folder(self, folder: str) -> bool:
        """Whether `folder` holds a module of this kind (its first config file)."""
        return os.path.isfile(os.path.join(folder, self.config_files[0]))

    def load(self, cls: type, folder: str, **kwargs) -> nn.Module:
        """The module of `folder`, whole, as its library loads it (`kwargs`: `dtype`, `device_map`, ...)."""
        raise NotImplementedError(f"{self.name} modules cannot be loaded from a folder")

    def build_empty(self, cls: type, folder: str, name_or_path: str) -> nn.Module:
        """The module of `folder` as its library's loading builds it, its parameters on the meta device (buffers
        computed for real), in its loading dtypes: `hf_omni` then reads each rank's rows of the weights files."""
        raise NotImplementedError(f"{self.name} modules cannot be built on the meta device")

    def empty_copy(self, module: nn.Module) -> nn.Module:
        """A model of `module`'s own class and configuration, its parameters on the meta device (what a LoRA merge
        by PEFT is built on)."""
        raise NotImplementedError(f"{self.name} modules cannot be copied on the meta device")

    def write_config(self, module: nn.Module, folder: str, dtype=None) -> None:
        """The folder's non-weight files of `module` (`dtype`: the one its weights are exported in, or None)."""
        raise NotImplementedError

    def save_view(self, module: nn.Module) -> nn.Module:
        """What the save-time key conversion runs on (a module wrapped in place: a view of its own class)."""
        return module

    def keys_to_ignore(self, view: nn.Module) -> list[str]:
        """State-dict keys a save leaves out."""
        return []

    def convert_keys(self, view: nn.Module, state: dict) -> dict:
        """`state` under the keys the files hold (a renamed tensor keeps its identity; a derived one is new)."""
        return dict(state)

    def source_path(self, module: nn.Module) -> str:
        """Where the module was loaded from (a folder or a Hub id; "" when unknown)."""
        return ""

    def checkpointed_models(self, module: nn.Module) -> list[tuple[nn.Module, list[nn.Module]]]:
        """`activation_checkpointing`: (a model whose own `activation_checkpointing_enable` covers part of `module`,
        the submodules inside it that belong to other modules), for each; none: refused, naming the module. The
        default: the module itself when it supports gradient checkpointing as transformers' models do."""
        return [(module, [])] if getattr(module, "supports_gradient_checkpointing", False) else []

    def enable_checkpointing(self, model: nn.Module, kwargs: dict, every_n_layers: int, offload: bool) -> None:
        """Turn on a `checkpointed_models` model's own checkpointing (transformers' `activation_checkpointing_enable`;
        a ValueError: it cannot, said naming the module)."""
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs, every_n_layers=every_n_layers,
                                              offload=offload)

    def no_checkpointing_reason(self, module: nn.Module) -> str:
        return f"{type(module).__name__} does not support activation checkpointing"

    def describe(self, module: nn.Module) -> dict:
        """The module's configuration as JSON-able values (an offline cache's fingerprint hashes it). The default:
        its `config.to_dict()` (transformers' and the adopted part's) less where and by what it was saved."""
        config = getattr(module, "config", None)
        values = config.to_dict() if hasattr(config, "to_dict") else {}
        return {k: v for k, v in values.items() if k not in ("_name_or_path", "transformers_version")}

    def card_usage(self, record: str, repo_id: str, subfolder: str | None) -> list[str]:
        """Model card lines that show how to load the module alone (markdown)."""
        return []

    def rebuild_difference(self, cls: type, folder: str, origin: str) -> str | None:
        """Why `origin` (a Hub snapshot) loaded with `cls` would not give the configuration saved in `folder`; None:
        it would (its tensors are compared apart). The default: never linked, always uploaded."""
        return "its format does not say how to compare it with the repo"


FORMATS = Registry("module_format", ModuleFormat, instances=True)


def register_module_format(cls: type) -> type:
    """Make a kind of module of your own usable as a module of a composed model (usable as a decorator): a
    `ModuleFormat` subclass, consulted before the formats registered earlier and hf_omni's own."""
    return FORMATS.register(cls)


def original_class(module: nn.Module) -> type:
    """The module's own class, under any in-place wrapper subclass (`FSDPLlama...`, `DDPLlama...`)."""
    wrappers = in_place_wrapper_classes()
    cls = type(module)
    while len(cls.__bases__) == 2 and cls.__bases__[0] in wrappers:
        cls = cls.__bases__[1]
    return cls


def format_of(module_or_class) -> ModuleFormat:
    """The format of a module (under any in-place wrapper) or of a module class; a clear error for no format."""
    cls = module_or_class if isinstance(module_or_class, type) else original_class(module_or_class)
    for fmt in FORMATS:
        if fmt.handles(cls):
            return fmt
    raise ValueError(f"{cls.__name__} is no kind of module hf_omni knows: a transformers PreTrainedModel, or a "
                     "class of a format registered with hf_omni.register_module_format")


def record_class(cls: type, module: str) -> str:
    """Module `module`'s class as its format records it in the root config."""
    return format_of(cls).class_record(cls, module)


def resolve_class(record: str, module: str) -> type:
    """The class a root config records for `module`, asked of every format in order."""
    for fmt in FORMATS:
        found = fmt.resolve(record)
        if found is not None:
            return found
    raise ValueError(
        f"module {module!r}: class {record!r} is neither a transformers / hf_omni model, nor registered with "
        "hf_omni.register_module_class or an Auto class, nor a class of a registered module format (register your "
        "own classes before loading)")


def config_files() -> list[str]:
    """Every format's config file names (what marks a module folder)."""
    return [n for fmt in FORMATS for n in fmt.config_files]


def is_module_folder(folder: str) -> bool:
    return any(fmt.is_folder(folder) for fmt in FORMATS)


def folder_patterns() -> list[str]:
    """Every exported format's non-weight file names and patterns (copied, pushed and downloaded with a module)."""
    return list(dict.fromkeys(n for fmt in FORMATS if fmt.exported for n in (*fmt.config_files, *fmt.other_files)))


def index_names() -> list[str]:
    return list(dict.fromkeys(fmt.weights_index for fmt in FORMATS))


def weights_names(folder: str) -> tuple[str, str]:
    """(weights file, index) of the module folder `folder`: those of the first format whose index or weights file
    it holds (else transformers' names)."""
    for fmt in FORMATS:
        if any(os.path.isfile(os.path.join(folder, n)) for n in (fmt.weights_index, fmt.weights_file)):
            return fmt.weights_file, fmt.weights_index
    return "model.safetensors", "model.safetensors.index.json"
