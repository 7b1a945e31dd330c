"""`AdoptedModel`: a released composite model (LLaVA, Qwen2.5-VL, ...) trained per module as it is, built by
`OmniModel.from_model` (its composition: `compositions/adopted.py`, which saves it in the released format).

    model = OmniModel.from_model(LlavaForConditionalGeneration.from_pretrained(path), modules={
        "vision": "model.vision_tower", "projector": "model.multi_modal_projector",
        "llm": ["model.language_model", "lm_head"]}, processor=AutoProcessor.from_pretrained(path))

The released model's own `forward` and `generate` run unchanged (where its class has no training `forward`, the
step `adopt.omni` registers for it runs instead: Qwen2.5-Omni); each module (`parts.Part`) is trained, wrapped,
clipped and stepped as a composed model's is; what the driver, the checkpointer and offline encoding ask a
composed model (`model_hooks.ModelHooks`) it answers for the released one.
"""

from __future__ import annotations

import inspect
import types

from transformers import PreTrainedModel

from ..core.config import ModuleEntry, OmniConfig
from ..files.format import original_class
from ..formats.transformers_classes import class_record
from ..modeling import OmniModel
from ..offline.missing_modality import runs_collectives
from .inputs import check_same_inputs
from .omni import step_for
from .offline import released_encoder, released_method, released_specs, served_outputs, served_signature
from .owners import check_paths, claim_tied, normalise
from .parts import build_parts, sync_into

MODALITY_INPUTS = {"image": ["pixel_values", "image_grid_thw", "pixel_attention_mask"],
                   "video": ["pixel_values_videos", "video_grid_thw"], "audio": ["input_features", "input_values"]}


class AdoptedModel(OmniModel):
    """An `OmniModel` over a released model (`released`, not a child: its tensors are listed through the modules)."""

    label_shift = True  # the released model computes a causal LM's loss: it shifts the labels itself
    reduce_every_micro_step = True  # its forward decides per batch which modules run (`inputs.py`)
    encoders_from_settings = True  # `modules.<name>.offline_encoder` names a released method

    def __init__(self, config: OmniConfig, released: PreTrainedModel, processor=None):
        mapping = {entry.name: entry.extra["paths"] for entry in config.modules}  # in order: each entry's paths
        parts = build_parts(released, mapping)
        super().__init__(config, modules=parts)
        self.__dict__["released"] = released
        self.__dict__["adopted_processor"] = processor
        self.__dict__["released_step"] = step_for(released)  # a training step its class lacks, or None
        runner = self.released_step if self.released_step is not None else released
        signature = inspect.signature(runner.forward)
        self.argument_names = [n for n, p in signature.parameters.items()
                               if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)]

        def forward(self, *args, **kwargs):  # the released forward's signature: Trainer keeps the columns it takes
            return self.run_released(*args, **kwargs)

        forward.__signature__ = served_signature(inspect.signature(type(runner).forward))
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
        if self.released_step is not None:
            return self.released_step(*args, **kwargs)
        return self.released(*args, **kwargs)

    def offline_encoder_specs(self) -> dict:
        """Module -> its `offline_encoder` setting as a spec (`adopt.offline`)."""
        return released_specs(self)

    def offline_encoder_code(self, spec):
        method = released_method(self.released, spec.method)  # the class's function: its source is fingerprinted
        return getattr(type(method.__self__), method.__name__)

    def offline_encoder_call(self, spec):
        return released_encoder(self, spec)

    def modality_columns(self) -> dict[str, list[str]]:
        """`group_by_modality`: the released forward's inputs that carry each modality (those it takes)."""
        found = {kind: [c for c in columns if c in self.argument_names] for kind, columns in MODALITY_INPUTS.items()}
        return {kind: columns for kind, columns in found.items() if columns}

    def forward_owner(self) -> PreTrainedModel:
        """The released model: its class's `forward` names the labels (the instance's `forward` is set per object)."""
        return self.released

    def forward_class(self) -> type:
        """The class whose `forward` Trainer reads label names from: the released class's, or its step's."""
        return type(self.released_step if self.released_step is not None else self.released)

    def loss_modules(self) -> dict[str, str]:
        """A step's loss name -> the module owning the head that computes it (`loss/<module>` in the logs)."""
        if self.released_step is None:
            return {}
        owners = {}
        for loss, head in self.released_step.heads.items():
            for name, slot in self.slots.items():
                if any(head == p or head.startswith(p + ".") for p in slot.module.omni_paths):
                    owners[loss] = name
        return owners

    def window_counts(self) -> dict[str, str]:
        """A step's target columns -> the argument taking their count over the accumulation window and every rank."""
        return dict(self.released_step.counts) if self.released_step is not None else {}

    def targets_in(self, column: str, value):
        return self.released_step.targets_in(column, value)

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
