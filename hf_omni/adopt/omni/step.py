"""The base of a released model's training step and their registry (by the released class's name)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.utils import ModelOutput

STEPS: dict[str, type] = {}


def register_step(cls: type) -> type:
    STEPS[cls.released_class] = cls
    return cls


class ReleasedStep:
    """What a released class lacks for training: `forward(**batch)` returns the summed loss as `loss` and each part
    in `losses` (keyed like `heads`).

    - `heads`: loss name -> the released path of the head that computes it; the loss is logged as
      `loss/<module>` under the module that owns that head.
    - `counts`: a target column -> the `forward` argument that takes its count over the whole accumulation window
      and every rank (OmniTrainer counts it as Trainer counts `labels` for `num_items_in_batch`), so each loss is
      normalised like the text loss and one process equals many.
    """

    released_class = ""
    heads: dict[str, str] = {}
    counts: dict[str, str] = {}

    def __init__(self, released):
        self.released = released  # a plain object: its tensors stay the modules'

    def __call__(self, *args, **kwargs):
        return self.forward(*args, **kwargs)

    def forward(self, **batch):  # pragma: no cover - each family's
        raise NotImplementedError

    def targets_in(self, column: str, value: torch.Tensor) -> torch.Tensor:
        """How many targets a batch's `column` holds (those not -100, unless the family says otherwise)."""
        return (value != -100).sum()

    def save_files(self, folder: str) -> None:
        """Files the released class's `from_pretrained` reads that its `save_pretrained` does not write (main
        process, beside the released files)."""



@dataclass
class StepOutput(ModelOutput):
    """`loss`: the sum of `losses` (name -> its loss); `logits`: the text head's."""

    loss: torch.Tensor | None = None
    logits: torch.Tensor | None = None
    losses: dict | None = None


def token_loss(logits: torch.Tensor, targets: torch.Tensor, count=None) -> torch.Tensor:
    """Cross-entropy over the targets that are not -100, in fp32, as transformers' causal-LM loss: summed and divided
    by `count` (the window's targets over every rank) where given, else their mean."""
    logits = logits.float().flatten(0, -2)
    targets = targets.flatten().to(logits.device)
    if count is None:
        return torch.nn.functional.cross_entropy(logits, targets, ignore_index=-100)
    total = torch.nn.functional.cross_entropy(logits, targets, ignore_index=-100, reduction="sum")
    return total / (count.to(total.device) if torch.is_tensor(count) else count)
