"""`OmniModel.from_model`: a released composite model (LLaVA, Qwen2.5-VL, ...) trained per module as it is.

    model = OmniModel.from_model(LlavaForConditionalGeneration.from_pretrained(path), modules={
        "vision": "model.vision_tower", "projector": "model.multi_modal_projector",
        "llm": ["model.language_model", "lm_head"]}, processor=AutoProcessor.from_pretrained(path))

The released model's own `forward` and `generate` run unchanged; each module (`parts.Part`) is trained, wrapped,
clipped and stepped as a composed model's is. `save_pretrained` writes what the released class's own
`save_pretrained` writes (its config, generation config, processor and safetensors keys; LoRA merged into the
weights), plus `hf_omni.json`: the `modules=` mapping and the class, so that `OmniModel.from_pretrained` of the
folder adopts it again without the script. The folder loads with the released class alone.
"""

from __future__ import annotations

import dataclasses
import inspect
import os
import types

from transformers import PreTrainedModel

from ..core.config import ADOPTED_FILE, RELEASED_FOLDER, ModuleEntry, OmniConfig
from ..core.dist import is_main
from ..files.empty_init import build_empty
from ..formats.transformers_classes import class_record, original_class, resolve_module_class
from ..hub.download import download_module
from ..hub.ids import is_hub_id
from ..modeling import OmniModel
from ..modules.ema import ema_weights
from ..offline.missing_modality import runs_collectives
from .export import export_module_folders, export_original, module_folder_root
from .inputs import check_same_inputs
from .offline import released_encoder, released_specs, served_outputs, served_signature
from .owners import check_paths, claim_tied, normalise
from .parts import build_parts, sync_into

MODALITY_INPUTS = {"image": ["pixel_values", "image_grid_thw", "pixel_attention_mask"],
                   "video": ["pixel_values_videos", "video_grid_thw"], "audio": ["input_features", "input_values"]}


class AdoptedModel(OmniModel):
    """An `OmniModel` over a released model (`released`, not a child: its tensors are listed through the modules)."""

    label_shift = True  # the released model computes a causal LM's loss: it shifts the labels itself
    reduce_every_micro_step = True  # its forward decides per batch which modules run (`inputs.py`)
    encoders_from_settings = True  # `modules.<name>.offline_encoder` names a released method
    released_folder = RELEASED_FOLDER  # a checkpoint's copy in the released format (beside the modules' state)

    def __init__(self, config: OmniConfig, released: PreTrainedModel, processor=None):
        mapping = {entry.name: entry.extra["paths"] for entry in config.modules}  # in order: each entry's paths
        parts = build_parts(released, mapping)
        super().__init__(config, modules=parts)
        self.__dict__["released"] = released
        self.__dict__["adopted_processor"] = processor
        signature = inspect.signature(released.forward)
        self.argument_names = [n for n, p in signature.parameters.items()
                               if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)]

        def forward(self, *args, **kwargs):  # the released forward's signature: Trainer keeps the columns it takes
            return self.run_released(*args, **kwargs)

        forward.__signature__ = served_signature(inspect.signature(type(released).forward))
        self.forward = types.MethodType(forward, self)  # bound: a deep copy rebinds it to the copy

    @classmethod
    def adopt(cls, model, modules: dict, processor=None, **kwargs) -> "AdoptedModel":
        if isinstance(model, type):
            raise TypeError("from_model(cls, path, ...) takes the released class and a folder or repo id")
        if not isinstance(model, PreTrainedModel):
            raise ValueError(f"from_model: expected a transformers PreTrainedModel, got {type(model).__name__}")
        if kwargs:
            raise TypeError(f"from_model: unexpected arguments {sorted(kwargs)}")
        mapping = normalise(modules)
        check_paths(model, mapping)
        mapping = claim_tied(model, mapping)  # a tied head outside every module: its tied module's (recorded so)
        released_class = original_class(model)
        record = class_record(released_class, "(adopted model)")
        entries = [ModuleEntry(name, record, name, extra={"paths": paths}) for name, paths in mapping.items()]
        config = OmniConfig(modules=entries, omni_class=cls.__name__, adopted={"class": record})
        return cls(config, model, processor)

    # -- running ---------------------------------------------------------------------------------
    def run_released(self, *args, **kwargs):
        cached = served_outputs(self, kwargs)  # offline modules: their cached outputs, the forward's own way
        if runs_collectives(self):  # every rank given the same arguments, or all raise alike
            served = {c for s in self.slots.values() if s.encoder is not None for c in s.encoder.inputs}
            names = [n for n in self.argument_names if n not in served]  # what only offline modules read: no
            bound = dict(zip(self.argument_names, args), **kwargs)        # collective depends on it
            check_same_inputs(names, bound, [n for n, s in self.slots.items()
                                             if s.strategy is not None and s.strategy.collective])
        if cached:
            kwargs["mm_encoder_outputs"] = {**(kwargs.get("mm_encoder_outputs") or {}), **cached}
        return self.released(*args, **kwargs)

    def offline_encoder_specs(self) -> dict:
        """Module -> its `offline_encoder` setting as a spec (`adopt.offline`)."""
        return released_specs(self)

    def offline_encoder_code(self, spec):
        return getattr(type(self.released), spec.method)

    def offline_encoder_call(self, spec):
        return released_encoder(self, spec)

    def modality_columns(self) -> dict[str, list[str]]:
        """`group_by_modality`: the released forward's inputs that carry each modality (those it takes)."""
        found = {kind: [c for c in columns if c in self.argument_names] for kind, columns in MODALITY_INPUTS.items()}
        return {kind: columns for kind, columns in found.items() if columns}

    def forward_owner(self) -> PreTrainedModel:
        """The released model: its class's `forward` names the labels (the instance's `forward` is set per object)."""
        return self.released

    def generate(self, *args, **kwargs):
        return self.released.generate(*args, **kwargs)

    def get_input_embeddings(self):
        return self.released.get_input_embeddings()

    def train(self, mode: bool = True):
        self.released.train(mode)  # its own containers too (they are no module's)
        return super().train(mode)

    def sync_parts(self) -> None:
        """Submodules PEFT replaced inside a module, into the released model (`parts.sync_into`)."""
        sync_into(self.released, {n: s.module for n, s in self.slots.items()})

    @property
    def processors(self) -> dict:
        return {}

    # -- save / load -----------------------------------------------------------------------------
    def save_pretrained(self, save_directory, is_main_process: bool = True, merge_lora: bool = True,
                        max_shard_size: str | int = "50GB", module_folders: list[str] | None = None,
                        **kwargs) -> None:
        """The released class's own format, written as `OmniModel` writes its modules (every rank its own rows of a
        sharded module's tensors), and `hf_omni.json`. LoRA is always merged (`merge_lora` is ignored): the released
        format holds no adapters; `export_ema` modules write their EMA weights. `module_folders`: modules that are
        one `PreTrainedModel` (LLaVA's `model.vision_tower`) also written as `<save_directory>/<module>/`, each
        loadable alone."""

        if kwargs.get("state_dict") is not None:
            raise ValueError("AdoptedModel.save_pretrained writes its modules' own state; `state_dict=` is not "
                             "supported")
        for name in module_folders or []:
            module_folder_root(self, name)  # refused before anything is written
        save_directory, is_main_process = str(save_directory), is_main_process and is_main()
        with ema_weights(self):  # `export_ema` modules: their EMA weights (a checkpoint's released copy too)
            export_original(self, save_directory, is_main_process, max_shard_size)
            if module_folders:
                export_module_folders(self, save_directory, list(module_folders), is_main_process, max_shard_size)
        if is_main_process:
            self.omni_config().to_json_file(os.path.join(save_directory, ADOPTED_FILE))

    def omni_config(self) -> OmniConfig:
        """The mapping, the released class, each module's recorded source and, once prepared, whether it trained."""
        entries = [dataclasses.replace(s.entry, trained=s.trains if self.prepared is not None else s.entry.trained)
                   for s in self.slots.values()]
        return OmniConfig(modules=entries, omni_class=type(self).__name__, adopted=self.config.adopted)

    def write_config(self, directory: str) -> None:
        """A checkpoint's root `config.json` (its modules' folders beside it, keyed by the released names)."""
        self.omni_config().save_pretrained(directory)

    @classmethod
    def from_saved(cls, folder: str, revision: str | None = None, token=None, cache_dir=None,
                   **kwargs) -> "AdoptedModel":
        """A folder `save_pretrained` wrote (or a repo it was pushed to): the released class loads it, then it is
        adopted with its mapping."""

        if is_hub_id(folder):  # the repo's released-format files, at one commit

            folder = download_module(folder, revision, "(adopted model)", token, cache_dir)
        config = OmniConfig.from_json_file(os.path.join(folder, ADOPTED_FILE))
        released_class = resolve_module_class(config.adopted["class"], "(adopted model)")
        released = released_class.from_pretrained(folder, **kwargs)
        processor = None
        if any(os.path.isfile(os.path.join(folder, n)) for n in ("processor_config.json", "preprocessor_config.json",
                                                                 "tokenizer_config.json")):
            from transformers import AutoProcessor

            processor = AutoProcessor.from_pretrained(folder)
        return cls.adopt(released, {e.name: e.extra["paths"] for e in config.modules}, processor=processor).eval()


def from_model(model, pretrained=None, *, modules: dict, processor=None, empty_init: bool = False,
               **kwargs) -> AdoptedModel:
    """`from_model(instance, modules=...)`, or `from_model(ReleasedClass, "folder-or-repo", modules=...,
    **from_pretrained_kwargs)`: the class's own `from_pretrained` loads it (every rank its copy). `empty_init=True`:
    built on the meta device instead, each module pending on the released files, which `OmniPlugin.prepare` reads
    after wrapping (a sharded module: each rank its own rows; `modules.weights`)."""
    if isinstance(model, type):
        if not issubclass(model, PreTrainedModel) or pretrained is None:
            raise TypeError("from_model(cls, path, modules=...): cls a transformers model class and path its folder "
                            "or repo id")
        if empty_init:
            return adopt_empty(model, str(pretrained), modules, processor, **kwargs)
        model = model.from_pretrained(pretrained, **kwargs)
        kwargs = {}
    elif pretrained is not None or empty_init:
        raise TypeError("from_model(instance, modules=...) takes no path and no empty_init: the instance holds its "
                        "weights (empty_init: from_model(cls, path, ...))")
    return AdoptedModel.adopt(model, modules, processor=processor, **kwargs)


def adopt_empty(released_class, pretrained: str, modules: dict, processor=None, **kwargs) -> AdoptedModel:
    """The released model built as `from_pretrained` would build it (saved dtype, ties, keep-in-fp32 plan,
    generation config), on the meta device; every module pending on the released folder."""

    hub = {k: kwargs.pop(k, None) for k in ("revision", "token", "cache_dir")}
    if kwargs:
        raise TypeError(f"from_model(..., empty_init=True) takes no {sorted(kwargs)}: the module's dtype and "
                        "placement are its `modules:` settings")
    folder = pretrained
    if not os.path.isdir(folder) and is_hub_id(folder):
        folder = download_module(pretrained, hub["revision"], "(adopted model)", hub["token"], hub["cache_dir"])
    if not os.path.isfile(os.path.join(folder, "config.json")):
        raise FileNotFoundError(f"from_model: {pretrained} has no config.json: not a saved {released_class.__name__}")
    model = AdoptedModel.adopt(build_empty(released_class, folder), modules, processor=processor)
    for slot in model.slots.values():
        slot.pend(folder)
    return model
