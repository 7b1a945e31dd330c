"""OmniTrainer's evaluation and prediction: before `train()` the modules are prepared as training will run them
(sharded, read, served offline); the outputs left out of predictions are those the forward's own config names; a
dataset given after the offline modules left for the meta device is refused (it has no cache)."""

from __future__ import annotations

from ..offline.serve import CachedRows


class EvaluationMixin:
    """`evaluate` / `predict` of an `OmniTrainer` (its plugin, model and `_serve_offline`)."""

    def evaluate(self, eval_dataset=None, ignore_keys=None, metric_key_prefix: str = "eval"):
        self._prepare_modules_for_eval()
        return super().evaluate(eval_dataset, ignore_keys, metric_key_prefix)

    def predict(self, test_dataset, ignore_keys=None, metric_key_prefix: str = "test"):
        self._prepare_modules_for_eval()
        return super().predict(test_dataset, ignore_keys, metric_key_prefix)

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        """The outputs left out of the predictions: those the forward's own config names, as Trainer on it reads
        (none named: Trainer's own default, which differs between releases)."""
        if ignore_keys is None:
            config = getattr(self.model.forward_owner(), "config", None)
            ignore_keys = getattr(config, "keys_to_ignore_at_inference", None)
        return super().prediction_step(model, inputs, prediction_loss_only, ignore_keys)

    def _prepare_modules_for_eval(self) -> None:
        """Before `train()`: the modules prepared as training will run them (sharded, read, served offline)."""
        if self.plugin.modules_prepared:
            return
        if self.plugin.offline:
            self._serve_offline()
        self.plugin.prepare_modules(self.accelerator, self.model)
        self.model_wrapped = self.model

    def get_eval_dataloader(self, eval_dataset=None):
        self._check_served(eval_dataset)
        return super().get_eval_dataloader(eval_dataset)

    def get_test_dataloader(self, test_dataset):
        self._check_served(test_dataset)
        return super().get_test_dataloader(test_dataset)

    def _check_served(self, dataset) -> None:
        released = [n for n, slot in self.model.slots.items() if slot.is_offline]
        if released and dataset is not None and not isinstance(dataset, (str, CachedRows)):
            raise ValueError(f"modules {released} are offline (on the meta device since train()): a dataset given "
                             "to evaluate() / predict() now has no cache; pass it as eval_dataset= before train()")
