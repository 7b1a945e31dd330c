"""The training data of `OmniTrainer`: datasets served from offline caches (and, for ragged outputs, the collator
over them), and the training sampler: Trainer's own, or with `group_by_modality: true` one that makes every global
batch carry the same modalities on every rank (`offline.modality_sampler`)."""

from __future__ import annotations

from transformers import TrainerCallback

from ..core.dist import checkpoint_group
from ..offline.modality_sampler import modality_sampler
from ..offline.ragged import ServedCollator


class TrainingDataMixin:
    """Of a Trainer subclass whose `args` are `OmniTrainingArguments` and that has an `OmniPlugin` as `plugin`."""

    def _serve_offline(self) -> None:
        """`offline_modules`: the train and eval datasets served from the modules' caches (encoded first where none
        is valid), the modules released to the meta device (`OmniPlugin.offline_datasets`)."""
        evals, splits = self.eval_dataset, {"train": self.train_dataset}
        splits.update({f"eval-{k}": v for k, v in evals.items()} if isinstance(evals, dict) else
                      {"eval": evals} if evals is not None else {})
        served = self.plugin.offline_datasets(self.model, {k: v for k, v in splits.items() if v is not None},
                                              self.data_collator, self.args.per_device_eval_batch_size,
                                              self.args.device)
        self.train_dataset = served.get("train")
        if any(spec.ragged for spec in self.plugin.offline.values()):  # ragged outputs: in their method's form
            self.data_collator = ServedCollator(self.data_collator, list(self.plugin.offline.values()))
        if evals is not None:
            self.eval_dataset = {k: served[f"eval-{k}"] for k in evals} if isinstance(evals, dict) else served["eval"]

    def _get_train_sampler(self, train_dataset=None):
        if not self.args.group_by_modality:
            return super()._get_train_sampler(train_dataset)
        dataset = train_dataset if train_dataset is not None else self.train_dataset
        seed = self.args.data_seed if self.args.data_seed is not None else self.args.seed
        sampler = modality_sampler(self.model, dataset, self._train_batch_size, self.args.world_size, seed,
                                   shuffle=self.args.train_sampling_strategy != "sequential",
                                   group=checkpoint_group(self.args.ddp_timeout))
        epochs = next((cb for cb in self.callback_handler.callbacks if isinstance(cb, SamplerEpoch)), None)
        if epochs is None:
            self.add_callback(epochs := SamplerEpoch())
        epochs.sampler = sampler
        return sampler


class SamplerEpoch(TrainerCallback):
    """The epoch of the modality sampler at each epoch's start. Trainer's own `set_epoch` does not reach it after a
    resume has skipped batches (the skipping sampler wraps it), which would replay epoch 0's order."""

    sampler = None

    def on_epoch_begin(self, args, state, control, **kwargs):
        if self.sampler is not None:
            self.sampler.set_epoch(int(state.epoch or 0))  # whole at an epoch's start; a resumed one's is within it
