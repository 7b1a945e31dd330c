"""Training steps for released models whose class has none: `Qwen2_5OmniForConditionalGeneration` implements no
`forward` (its step: `qwen2_5_omni`), nor does Qwen3-Omni-MoE's (`qwen3_omni_moe`, every codebook); Janus'
`labels` give its text loss only (its step, with image generation: `janus`). Each is built from the release's own
parts, one file per family, registered by the released class's name (`step`: their base and registry;
`thinker_talker`: the forward both Qwen omni families share).
`AdoptedModel` runs a registered step in place of the released `forward`; everything else (modules, wrapping,
checkpoints, the export in the released format) is as for any adopted model."""

from __future__ import annotations

from . import janus, qwen2_5_omni, qwen3_omni_moe  # noqa: F401  (each registers its step)
from .step import STEPS, ReleasedStep


def step_for(released) -> ReleasedStep | None:
    """The registered step of `released`'s class (its own or a base's), or None: its own `forward` serves."""
    for klass in type(released).__mro__:
        if klass.__name__ in STEPS:
            return STEPS[klass.__name__](released)
    return None
