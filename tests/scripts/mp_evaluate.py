"""`evaluate()` / `predict()` / `compute_metrics` / `load_best_model_at_end` on an adopted LLaVA, at 1 process or in
one launch of 2 gloo ranks (vision frozen under FSDP, projector DDP, LoRA LLM under FSDP); tests/
test_adopted_evaluation.py compares the two and each with plain `Trainer` on the release. Usage: mp_evaluate.py OUT

What a run records: metrics before training, predictions with `eval_do_concat_batches` either way, the eval losses
of a 3-step run that evaluates and saves every step and loads the best at the end, and predictions after it.
"""

import os
import sys

import torch
from helpers import make_args
from launching import end_distributed
from released_models import BUILDERS, MODULES, Rows, collate

from hf_omni import OmniModel, OmniTrainer

LORA = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]}
PARALLEL = {"vision": {"trainable": False, "parallel": "fsdp"},
            "projector": {"learning_rate": 1e-1, "parallel": "ddp"},
            "llm": {"lora": LORA, "learning_rate": 1e-2, "parallel": "fsdp"}}
EVAL_ROWS = 10  # 1 process: batches of 4, 4, 2; 2 ranks: each rank 2 rows a step, the last step uneven


def token_accuracy(prediction) -> dict:
    """A metric over what Trainer hands `compute_metrics`: the logits' next-token accuracy on the labelled tokens."""
    logits, labels = logits_of(prediction.predictions).numpy(), flat(prediction.label_ids).numpy()
    guess, target = logits[:, :-1].argmax(-1), labels[:, 1:]
    kept = target != -100
    return {"accuracy": float((guess[kept] == target[kept]).mean()), "rows": int(labels.shape[0])}


def logits_of(predictions) -> torch.Tensor:
    """The logits of Trainer's predictions (a tuple of the outputs kept; per step with `eval_do_concat_batches:
    false`)."""
    if isinstance(predictions, list):
        return flat([step[0] if isinstance(step, tuple) else step for step in predictions])
    return flat(predictions[0] if isinstance(predictions, tuple) else predictions)


def flat(predictions):
    """`eval_do_concat_batches: false` gives a list of per-step arrays: concatenated, as `true` gives them (a tensor,
    so that the results load with `weights_only=True`)."""
    import numpy as np

    return torch.from_numpy(np.concatenate(predictions) if isinstance(predictions, list) else predictions)


def logits_only(released, rows) -> None:
    """Every output but the loss and the logits left out of the predictions, named by the release's own config (as
    plain Trainer reads it): LLaVA's vision outputs hold `None` entries, which Trainer cannot pad across processes,
    and the cache's output name differs between transformers releases."""
    with torch.no_grad():
        keys = released(**collate([rows[0], rows[1]])).keys()
    released.config.keys_to_ignore_at_inference = [k for k in keys if k not in ("loss", "logits")]


def run(out_dir: str, world: int) -> dict:
    model = OmniModel.from_model(BUILDERS["llava"](), modules=MODULES["llava"])
    rows = Rows("llava", model.released, 24, seed=1)
    held_out = Rows("llava", model.released, EVAL_ROWS, seed=2)
    logits_only(model.released, held_out)
    args = make_args(out_dir, modules=PARALLEL, per_device_train_batch_size=8 // world,
                     per_device_eval_batch_size=4 // world, max_steps=3, eval_strategy="steps", eval_steps=1,
                     save_strategy="steps", save_steps=1, load_best_model_at_end=True,
                     metric_for_best_model="eval_loss", greater_is_better=True,  # the highest: not the last step's
                     lr_scheduler_type="constant", dataloader_drop_last=False)
    trainer = OmniTrainer(model=model, args=args, train_dataset=rows, eval_dataset=held_out, data_collator=collate,
                          compute_metrics=token_accuracy)
    result = {"label_names": trainer.label_names, "before": trainer.evaluate()}
    for concat in (True, False):
        trainer.args.eval_do_concat_batches = concat
        out = trainer.predict(held_out)
        result[f"predict_{concat}"] = {"predictions": logits_of(out.predictions),
                                       "label_ids": flat(out.label_ids), "metrics": out.metrics}
    trainer.args.eval_do_concat_batches = True
    trainer.train()
    result["eval_losses"] = [e["eval_loss"] for e in trainer.state.log_history if "eval_loss" in e]
    result["best"] = (trainer.state.best_metric, os.path.basename(trainer.state.best_model_checkpoint or ""))
    result["after"] = trainer.evaluate()
    trainer.save_model(os.path.join(out_dir, "export"))
    return result


if __name__ == "__main__":
    import torch.distributed as dist

    out = sys.argv[1]
    found = run(os.path.join(out, "run"), world=int(os.environ.get("WORLD_SIZE", "1")))
    if dist.get_rank() == 0:
        torch.save({k: v for k, v in found.items()}, os.path.join(out, "results.pt"))
    end_distributed()
