"""`label_smoothing_factor` for a composed model: smoothed where the loss is computed, inside the module.

Trainer smooths the model's logits against the batch's labels itself, shifting them only when the model's class
is a causal LM. A composed model's logits are the LLM module's, over a sequence its `forward` built (a prefix
prepended, labels extended with -100): Trainer's logits and labels no longer line up. So OmniTrainer keeps the
labels in the batch and gives each module that computes a causal or masked LM loss a smoothed loss function; the
module then smooths exactly the targets it uses (its own shift, its own ignored positions). A step whose loss no
module's loss function computed is refused (`check`), never trained unsmoothed.

The smoothed loss is torch's `cross_entropy(label_smoothing=eps)`: (1 - eps) * nll + eps * mean over the vocabulary
of -log p, the same as Trainer's `LabelSmoother`, and normalised like the module's own loss (`num_items_in_batch`).
"""

from __future__ import annotations

import torch
from torch.nn import functional as F

from ..core.errors import OmniArgumentError

SHIFTS = {"ForCausalLM": True, "ForConditionalGeneration": True, "ForMaskedLM": False}  # loss_type -> shifts?


class SmoothedLoss:
    """A module's `loss_function` with label smoothing; counts its calls."""

    def __init__(self, epsilon: float, shift: bool):
        self.epsilon, self.shift, self.calls = epsilon, shift, 0

    def __call__(self, logits, labels, vocab_size: int, num_items_in_batch=None, ignore_index: int = -100,
                 shift_labels=None, **kwargs):
        self.calls += 1
        logits = logits.float()
        targets = labels
        if self.shift:
            targets = shift_labels if shift_labels is not None else F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
        reduction = "sum" if num_items_in_batch is not None else "mean"
        loss = F.cross_entropy(logits.reshape(-1, vocab_size), targets.reshape(-1).to(logits.device),
                               ignore_index=ignore_index, reduction=reduction, label_smoothing=self.epsilon)
        if reduction == "sum":
            count = num_items_in_batch
            loss = loss / (count.to(loss.device) if torch.is_tensor(count) else count)
        return loss


def install(model, epsilon: float) -> list[SmoothedLoss]:
    """Give every module whose loss is a causal / masked LM loss a smoothed one; refused when there is none."""
    installed = []
    for module in model.omni_modules().values():
        shift = SHIFTS.get(getattr(module, "loss_type", None) or "")
        if shift is not None:
            module.loss_function = SmoothedLoss(epsilon, shift)
            installed.append(module.loss_function)
    if not installed:
        raise OmniArgumentError(None, "label_smoothing_factor", "no module computes a causal or masked LM loss "
                                f"({sorted(SHIFTS)} by its loss_type) to smooth: smooth the loss in your forward, or "
                                "set label_smoothing_factor: 0")
    return installed


def calls(installed: list[SmoothedLoss]) -> int:
    return sum(loss.calls for loss in installed)


def check(installed: list[SmoothedLoss], before: int) -> None:
    """After a forward given labels: one of the smoothed losses computed its loss."""
    if calls(installed) == before:
        raise OmniArgumentError(None, "label_smoothing_factor", "the model's loss did not come from a module's "
                                "causal / masked LM loss function, so it cannot be smoothed there (a module that "
                                "computes its own cross-entropy?): smooth it in your forward, or set "
                                "label_smoothing_factor: 0")
