"""`loss/<module>` in the logs, for a model whose forward returns several losses (`outputs.losses`, name -> loss;
the model's `loss_modules()` names each loss's module: Qwen2.5-Omni's text loss under the module owning the
thinker's head, its codec loss under the talker's) and the target counts its losses are normalised by.

Each part is accumulated on the device as Trainer accumulates `loss` (scaled as Trainer scales it, summed over the
micro-steps; `loss` is the sum of the parts), and read only at logging steps: one gather over the ranks, averaged,
per optimizer step since the last log, so the parts add up to the logged `loss`."""

from __future__ import annotations

import torch


def count_targets(model, batches: list, accelerator, args) -> None:
    """Each of the model's `window_counts()` columns counted over the window's batches (`targets_in`), summed
    over the ranks as Trainer sums `num_items_in_batch`, and handed to every batch holding the column."""
    for column, argument in model.window_counts().items():
        holding = [b for b in batches if column in b and b[column] is not None]
        if not holding:
            continue
        count = sum(model.targets_in(column, b[column]) for b in holding)
        if args.average_tokens_across_devices and args.world_size > 1:
            count = accelerator.gather(count.to(accelerator.device)).sum()
        for batch in holding:
            batch[argument] = count


class LossPartsMixin:
    """Of a Trainer subclass whose `model` is an `OmniModel`."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        names = self.model.loss_modules()
        if not names or not self.model.training:
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        loss, outputs = super().compute_loss(model, inputs, True, num_items_in_batch)
        parts = {n: p.detach() for n, p in (outputs.get("losses") or {}).items() if n in names}
        if not parts:
            return (loss, outputs) if return_outputs else loss
        total = sum(outputs["losses"].values()).detach()  # the loss before Trainer scaled it (in place)
        scale = torch.where(total != 0, loss.detach() / total, torch.zeros_like(total))  # Trainer's world factor
        scaled_for_window = (self.model_accepts_loss_kwargs and num_items_in_batch is not None) \
            or self.compute_loss_func is not None
        if not scaled_for_window:
            scale = scale / self.current_gradient_accumulation_steps
        sums = self.__dict__.setdefault("loss_part_sums", {})
        for name, part in parts.items():
            sums[name] = sums.get(name, 0) + part * scale
        return (loss, outputs) if return_outputs else loss

    def loss_part_logs(self) -> dict[str, float]:
        """At a logging step (every rank): each part's mean per optimizer step since the last, averaged over ranks."""
        names = self.model.loss_modules()
        if not names:
            return {}
        sums = self.__dict__.pop("loss_part_sums", {})
        since = self.__dict__.get("loss_parts_logged", 0)
        steps = max(self.state.global_step - since, 1)
        self.loss_parts_logged = self.state.global_step
        device = self.args.device
        local = torch.stack([torch.as_tensor(sums.get(n, 0.0), dtype=torch.float32, device=device).reshape(())
                             for n in names])
        everyone = self.accelerator.gather(local[None]) if self.args.world_size > 1 else local[None]
        means = (everyone.view(-1, len(names)).mean(0) / steps).tolist()  # a logging step: the one host read
        return {f"loss/{names[n]}": v for n, v in zip(names, means)}
