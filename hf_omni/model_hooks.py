"""What the driver, the checkpointer and offline encoding ask a composed model, with a composed model's answers; an
adopted model (`adopt.model.AdoptedModel`) overrides them, so no other file checks which kind of model it has."""

from __future__ import annotations

import functools

from .offline.spec import OfflineEncoder, class_encoders, declared_encoders
from .offline.window import deferred_problem, one_call


class ModelHooks:
    """The methods `OmniModel` answers for its own modules and an adopted model answers for its released one."""

    reduce_every_micro_step = False  # its forward decides per batch which modules run: no accumulation window
    encoders_from_settings = False  # its offline encoders are named by `modules.<name>.offline_encoder`

    def __init_subclass__(cls, **kwargs):
        """A subclass that can `generate` (`GenerationMixin`): the missing-modality exchange of its forwards agreed
        per call, not per token (`offline.window.one_call`)."""
        super().__init_subclass__(**kwargs)
        if callable(getattr(cls, "generate", None)):
            cls.generate = one_call(cls.generate)

    def deferred_problem(self) -> str | None:
        """A problem this rank found inside an accumulation window and keeps for the window's next agreement
        (`offline.window.defer`), or one a split module's boundary keeps on the device (`hf_omni_pending_problem`,
        read here: a mask a sequence-parallel module cannot serve): a checkpoint raises it before anything is
        written, and the run's end too."""
        problem = deferred_problem(self)
        for module in self.modules():
            pending = module.__dict__.get("hf_omni_pending_problem")
            problem = problem or (pending() if pending is not None else None)
        return problem

    def sync_parts(self) -> None:
        """Before its modules are prepared: what freezing and LoRA replaced, into the model whose forward runs."""

    def offline_encoder_specs(self) -> dict[str, OfflineEncoder]:
        """Module -> its offline entry point: the `@offline_encoder` methods its class declares."""
        return declared_encoders(type(self))

    def offline_encoder_call(self, spec: OfflineEncoder):
        """What encodes `spec`'s inputs, without the cross-rank exchange: the decorated method's own body."""
        return functools.partial(getattr(type(self), spec.method).encoder_function, self)

    def offline_encoder_code(self, spec: OfflineEncoder):
        """The function whose source is part of an offline cache's fingerprint."""
        return getattr(type(self), spec.method)

    def modality_columns(self) -> dict[str, list[str]]:
        """`group_by_modality`: each entry point's columns (a row carries a modality when it has them)."""
        return {s.module: list(s.inputs) + [s.output] for s in class_encoders(type(self))}
