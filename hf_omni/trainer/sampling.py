"""The training sampler of `OmniTrainer`: Trainer's own, or with `group_by_modality: true` one that makes every
global batch carry the same modalities on every rank (`offline.modality_sampler`)."""

from __future__ import annotations

from ..dist import checkpoint_group
from ..offline.modality_sampler import modality_sampler


class ModalitySamplingMixin:
    """`_get_train_sampler` of a Trainer subclass whose `args` are `OmniTrainingArguments`."""

    def _get_train_sampler(self, train_dataset=None):
        if not self.args.group_by_modality:
            return super()._get_train_sampler(train_dataset)
        dataset = train_dataset if train_dataset is not None else self.train_dataset
        return modality_sampler(self.model, dataset, self.args.per_device_train_batch_size, self.args.world_size,
                                self.args.seed, shuffle=self.args.train_sampling_strategy != "sequential",
                                group=checkpoint_group(self.args.ddp_timeout))
