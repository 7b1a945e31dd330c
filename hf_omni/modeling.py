"""`OmniModel`: a composed model of named Hugging Face sub-models (modules).

Subclass it and write `forward`; each module is an attribute named by its key::

    class Captioner(OmniModel):
        def forward(self, pixel_values, input_ids, labels=None, **kw):
            prefix = self.projector(self.vision(pixel_values=pixel_values).last_hidden_state)
            embeds = torch.cat([prefix, self.llm.get_input_embeddings()(input_ids)], dim=1)
            return self.llm(inputs_embeds=embeds, labels=labels, **kw)

    model = Captioner.from_modules({"vision": vit, "projector": proj, "llm": lm}, processors={"llm": tok})
    model.save_pretrained("out")        # out/config.json + out/<module>/ (each loads alone)
    Captioner.from_pretrained("out")

Loss normalisation: Trainer passes `num_items_in_batch` to a `forward` with `**kw` and counts it from the instance's
`loss_type`. `label_shift = False` (default) counts every label that is not -100 (right when the forward prepends -100
labels and lets the LLM shift); `True` counts `labels[..., 1:]` (a forward that hands its labels straight to a causal
LM). A forward that drops `**kw` gets its loss scaled by world size x accumulation steps.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from typing import Any

from torch import nn
from transformers import PreTrainedModel

from .core.config import OmniConfig
from .core.dist import is_main
from .files.composition import COMPOSITIONS, Composition, composition_of, saved_composition
from .hub.push import push_saved
from .model_hooks import ModelHooks
from .modules.embeddings import model_input_embeddings
from .modules.slot import ModuleSlot
from .offline.missing_modality import before_forward, keep_in_graph


class OmniModel(ModelHooks, PreTrainedModel):
    """A composed model. Modules are attributes; `config` is an `OmniConfig` recording them; `slots[name]` is what
    is kept about each (`modules.slot.ModuleSlot`)."""

    config_class = OmniConfig
    base_model_prefix = "omni"
    main_input_name = "input_ids"
    label_shift: bool = False
    input_embeddings_module: str | None = None  # the module whose token embeddings are the model's (NEFTune)

    def __init__(self, config: OmniConfig, modules: dict[str, nn.Module] | None = None,
                 processors: dict[str, Any] | None = None):
        super().__init__(config)
        modules, processors = dict(modules or {}), dict(processors or {})
        missing = [n for n in config.module_names if n not in modules]
        if missing:
            raise ValueError(f"OmniModel: modules {missing} are in the config but were not given")
        for name in config.module_names:
            if hasattr(type(self), name) or name in dict(self.named_children()):
                raise ValueError(f"module {name!r}: the name clashes with an attribute of {type(self).__name__}")
            setattr(self, name, modules[name])
        self.slots = {e.name: ModuleSlot(e, modules[e.name], processors.get(e.name)) for e in config.modules}
        self._num_parameters: dict[bool, int] = {}
        self.prepared = None  # set by `OmniPlugin.prepare_modules`: `parallel.driver.Prepared`
        self.loss_type = "ForCausalLM" if self.label_shift else None
        self.register_forward_pre_hook(before_forward, with_kwargs=True)  # missing_modality.py: ranks
        self.register_forward_hook(keep_in_graph)  # whose batch lacks a module's input run it on a dummy

    # -- construction: each through its composition (`compositions/`) ----------------------------
    @classmethod
    def from_modules(cls, modules: dict[str, nn.Module], processors: dict[str, Any] | None = None,
                     sources: dict[str, str] | None = None) -> "OmniModel":
        """Compose `modules` (name -> a PreTrainedModel, or a module of a registered `ModuleFormat`). A module
        loaded from a local folder records it as its source (override with `sources`)."""
        return COMPOSITIONS["plain"].compose(cls, modules, processors, sources)

    @classmethod
    def from_model(cls, model, pretrained=None, *, modules: dict, processor=None, **kwargs) -> "OmniModel":
        """Adopt a released composite model as it is, `modules` mapping names to attribute paths
        (`compositions/adopted.py`); saved back in its released format."""
        return COMPOSITIONS["adopted"].compose(cls, model, pretrained, modules=modules, processor=processor, **kwargs)

    @classmethod
    def from_pipeline(cls, pipeline, path=None, **kwargs) -> "OmniModel":
        """Adopt a diffusers pipeline (`compositions/pipeline.py`); saved back as a pipeline folder."""
        return COMPOSITIONS["pipeline"].compose(cls, pipeline, path, **kwargs)

    def to_pipeline(self):
        """A live diffusers pipeline over the modules as they are (sampling during and after training)."""
        return COMPOSITIONS["pipeline"].live(self)

    @property
    def composition(self) -> Composition:
        """Its kind of composition, as its root config records it (`files.composition`)."""
        return composition_of(self.config)

    @property
    def module_names(self) -> list[str]:
        return self.config.module_names

    def forward_owner(self) -> nn.Module:
        """The model whose class's `forward` Trainer reads label names from (an adopted model's: the released one)."""
        return self

    def forward_class(self) -> type:
        """The class whose `forward` signature names the labels (Trainer's `find_labels`)."""
        return type(self.forward_owner())

    def loss_modules(self) -> dict[str, str]:
        """A loss the forward returns in `losses` -> the module it is logged under (`loss/<module>`)."""
        return {}

    def window_counts(self) -> dict[str, str]:
        """Target columns counted over the accumulation window and every rank -> the forward argument taking it."""
        return {}

    def targets_in(self, column: str, value):
        """How many targets a batch's `column` of `window_counts()` holds (those not -100)."""
        return (value != -100).sum()

    def omni_modules(self) -> dict[str, nn.Module]:
        return {name: slot.module for name, slot in self.slots.items()}

    @property
    def processors(self) -> dict[str, Any]:
        return {name: slot.processor for name, slot in self.slots.items() if slot.processor is not None}

    def floating_point_ops(self, input_dict, exclude_embeddings: bool = True) -> int:
        """Trainer calls this every step: 6 x tokens x parameters, with the parameter count cached."""
        if exclude_embeddings not in self._num_parameters:
            self._num_parameters[exclude_embeddings] = self.num_parameters(exclude_embeddings=exclude_embeddings)
        return 6 * self.estimate_tokens(input_dict) * self._num_parameters[exclude_embeddings]

    def get_input_embeddings(self) -> nn.Module:
        return model_input_embeddings(self)  # of `input_embeddings_module`, or of the one module that has them

    # -- training-mode handling -----------------------------------------------------------------
    def train(self, mode: bool = True):
        """Once prepared, fully frozen modules stay in eval mode (their output is a pure function of their input)."""
        super().train(mode)
        for slot in self.slots.values() if self.prepared is not None else ():
            if not slot.trains:
                slot.module.eval()
        return self

    def no_sync(self):
        """Skip gradient sync in every wrapped unit (Accelerate's `no_sync(model)` calls this)."""
        return self.prepared.no_sync() if self.prepared is not None else contextlib.nullcontext()

    # -- save / load: through its composition --------------------------------------------------
    def save_pretrained(self, save_directory: str | os.PathLike, is_main_process: bool = True,
                        merge_lora: bool = False, max_shard_size: str | int = "50GB", **kwargs) -> None:
        """Write `config.json` (OmniConfig) and one HF folder per module (with its processor; its weights split into
        files of at most `max_shard_size`, as transformers does), or what its composition writes instead (an
        adopted model: its released format; a pipeline: a pipeline folder). With sharded modules every rank must
        call it: each writes its own rows of their files in place (`merge_lora`: a LoRA module is gathered and
        merged on the main process); other modules, and the small files, are written by `is_main_process` (under a
        process group: only if it is global rank 0, so that a call on every rank without `is_main_process` does not
        race)."""
        if kwargs.pop("state_dict", None) is not None:
            raise ValueError(f"{type(self).__name__}.save_pretrained writes each module's own state; `state_dict=` is "
                             "not supported")
        self.composition.save(self, str(save_directory), is_main_process=is_main_process and is_main(),
                              merge_lora=merge_lora, max_shard_size=max_shard_size, **kwargs)

    def write_config(self, directory: str) -> None:
        """The root `config.json` and what its composition writes beside the module folders (a checkpoint's root)."""
        self.composition.write_root(self, directory)

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path: str | os.PathLike, *args, empty_init: bool = False,
                        device_map=None, dtype=None, merge_lora: bool = False, **kwargs) -> "OmniModel":
        """Rebuild the composed model from `save_pretrained` output (each module from its subfolder, or from its
        recorded source when the subfolder is absent; an adopted model's folder: its composition's). The eager
        build (one process, no process group; eval mode): `device_map` a device, `"auto"` (each module placed by
        transformers / Accelerate) or `{module: device}`; `dtype` one for all or `{module: dtype}`; LoRA modules keep
        their adapters unless `merge_lora=True` (merged by PEFT into plain weights). `empty_init=True` (training):
        modules are built on the meta device and remember their weights folder; `OmniPlugin.prepare` shards them
        first and reads each rank's shards after (see `hf_omni.files.weights`)."""
        if args:
            raise TypeError("OmniModel.from_pretrained takes the folder or repo id and keyword arguments only")
        root = str(pretrained_model_name_or_path)
        hub = {k: kwargs.pop(k, None) for k in ("revision", "token", "cache_dir")}
        kind = saved_composition(root, **hub) or COMPOSITIONS["plain"]
        return kind.load(cls, root, empty_init=empty_init, device_map=device_map, dtype=dtype, merge_lora=merge_lora,
                         **hub, **kwargs)

    def push_to_hub(self, repo_id: str, *, hub_layout: str | None = None, modules: dict | None = None,
                    token: str | None = None, private: bool | None = None, revision: str | None = None,
                    commit_message: str = "Upload with hf_omni", merge_lora: bool = False,
                    is_main_process: bool = True) -> dict[str, str] | None:
        """Save to a temporary folder and push it (`hub.push.push_saved`): per-module repos plus the composition repo
        `repo_id` (`hub_layout: per_module`), or one repo (`single`). `modules`: `{name: {push_to_hub, hub_model_id}}`.
        With sharded modules every rank calls it; the main process pushes. Returns `{repo: commit}`."""
        with tempfile.TemporaryDirectory(prefix="hf_omni_push_") as tmp:
            self.save_pretrained(tmp, is_main_process=is_main_process, merge_lora=merge_lora)
            if not is_main_process:
                return None
            return push_saved(tmp, repo_id, layout=hub_layout, modules=modules, token=token, private=private,
                              revision=revision, commit_message=commit_message)
