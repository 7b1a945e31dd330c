"""OmniTrainer's accumulation window: the missing-modality exchange of its batches agreed once per optimizer step
(`offline.window`). Trainer fetches a window's batches up front (`get_batch_samples`); their exchange is agreed
there in one all-gather, and each `training_step` opens its batch's turn. A model whose losses count other targets
than `labels` (`window_counts`) has them counted here too, as Trainer counts `labels`."""

from __future__ import annotations

from ..offline import window
from .loss_parts import count_targets


class StepWindowMixin:
    """Of a Trainer subclass whose `model` is an `OmniModel`."""

    def get_batch_samples(self, epoch_iterator, num_batches, device):
        batch_samples, num_items_in_batch = super().get_batch_samples(epoch_iterator, num_batches, device)
        window.agree_window(self.model, batch_samples, size=num_batches, turns=True)
        count_targets(self.model, batch_samples, self.accelerator, self.args)  # a step's other targets (codec codes)
        return batch_samples, num_items_in_batch

    def training_step(self, model, inputs, num_items_in_batch=None):
        window.begin_turn(self.model)
        return super().training_step(model, inputs, num_items_in_batch)
