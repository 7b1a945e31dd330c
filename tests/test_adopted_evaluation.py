"""Evaluation of an adopted model as plain `Trainer` evaluates the release: `label_names` from the released class's
`forward`, so `evaluate()` gives `eval_loss`, `compute_metrics` gets predictions and label ids, `predict()` returns
what Trainer returns on the release class (before and after training, `eval_do_concat_batches` either way), and
`load_best_model_at_end` on `eval_loss` restores the best step; the same at 2 ranks (tests/scripts/mp_evaluate.py)."""

import pytest
import torch
from released_models import BUILDERS, MODULES, Rows, collate
from scripts.mp_evaluate import EVAL_ROWS, flat, logits_of, logits_only, run, token_accuracy
from transformers import Trainer, TrainingArguments

from hf_omni import OmniModel, OmniTrainer, OmniTrainingArguments


def plain_predict(tmp_path, released, dataset, concat: bool = True):
    """Plain Trainer on the released class: the ground truth."""
    logits_only(released, dataset)
    args = TrainingArguments(output_dir=str(tmp_path / "plain"), use_cpu=True, report_to="none",
                             per_device_eval_batch_size=4, eval_do_concat_batches=concat)
    out = Trainer(model=released, args=args, data_collator=collate, compute_metrics=token_accuracy).predict(dataset)
    return logits_of(out.predictions), flat(out.label_ids), out.metrics


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    out = tmp_path_factory.mktemp("evaluate")
    return dict(run(str(out), world=1), out=out)


@pytest.mark.parametrize("family", ["llava", "qwen2_5_vl"])
def test_label_names_come_from_the_released_forward(tmp_path, family):
    released = BUILDERS[family]()
    model = OmniModel.from_model(released, modules=MODULES[family])
    trainer = OmniTrainer(model=model, args=OmniTrainingArguments(output_dir=str(tmp_path), use_cpu=True,
                                                                  report_to="none"), data_collator=collate)
    plain = Trainer(model=released, args=TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none"))
    assert trainer.label_names == plain.label_names == ["labels"]
    assert trainer.can_return_loss == plain.can_return_loss
    given = OmniTrainer(model=model, args=OmniTrainingArguments(output_dir=str(tmp_path), use_cpu=True,
                                                                report_to="none", label_names=["labels", "x"]))
    assert given.label_names == ["labels", "x"]  # the user's own, as Trainer keeps them


def test_composed_model_label_names_are_its_forward_s(tmp_path):
    from helpers import tiny_model

    trainer = OmniTrainer(model=tiny_model(), args=OmniTrainingArguments(output_dir=str(tmp_path), use_cpu=True,
                                                                         report_to="none"))
    assert trainer.label_names == ["labels"]


def test_evaluate_and_predict_equal_plain_trainer_before_and_after_training(tmp_path, one_process):
    released = BUILDERS["llava"]()
    held_out = Rows("llava", released, EVAL_ROWS, seed=2)
    predictions, label_ids, metrics = plain_predict(tmp_path, released, held_out)
    assert one_process["label_names"] == ["labels"]
    assert one_process["before"]["eval_loss"] == pytest.approx(metrics["test_loss"], abs=1e-6)
    assert one_process["before"]["eval_accuracy"] == metrics["test_accuracy"]
    assert one_process["before"]["eval_rows"] == EVAL_ROWS  # compute_metrics saw every row's labels
    for concat in (True, False):
        got = one_process[f"predict_{concat}"]
        assert got["predictions"].shape == predictions.shape  # the logits, not the loss
        assert (got["predictions"] - predictions).abs().max().item() <= 1e-6
        assert torch.equal(got["label_ids"], label_ids)
        assert got["metrics"]["test_loss"] == pytest.approx(metrics["test_loss"], abs=1e-6)
    trained = type(released).from_pretrained(one_process["out"] / "export")  # after training: the export
    _, _, after = plain_predict(tmp_path, trained, held_out)
    assert one_process["after"]["eval_loss"] == pytest.approx(after["test_loss"], abs=1e-5)


def test_load_best_model_at_end_restores_the_best_eval_loss(one_process):
    losses, (best, folder) = one_process["eval_losses"], one_process["best"]
    assert len(losses) == 3 and best == max(losses)  # greater_is_better: a step before the last one is the best
    assert losses.index(best) < 2 and abs(losses[-1] - best) > 1e-4, losses
    assert folder == f"checkpoint-{losses.index(best) + 1}"
    assert one_process["after"]["eval_loss"] == pytest.approx(best, abs=1e-6)


def test_two_ranks_evaluate_and_predict_as_one_process(tmp_path, launch_ranks, one_process):
    launch_ranks("mp_evaluate.py", str(tmp_path))
    ranks = torch.load(tmp_path / "results.pt", weights_only=True)
    assert ranks["label_names"] == ["labels"]
    assert ranks["before"]["eval_loss"] == pytest.approx(one_process["before"]["eval_loss"], abs=1e-6)
    assert ranks["before"]["eval_rows"] == EVAL_ROWS  # gathered once, no duplicated padding rows
    for concat in (True, False):
        got, want = ranks[f"predict_{concat}"], one_process[f"predict_{concat}"]
        assert (got["predictions"] - want["predictions"]).abs().max().item() <= 1e-5
        assert torch.equal(got["label_ids"], want["label_ids"])
    assert ranks["eval_losses"] == pytest.approx(one_process["eval_losses"], abs=1e-5)
    assert ranks["best"][1] == one_process["best"][1]
    assert ranks["after"]["eval_loss"] == pytest.approx(one_process["after"]["eval_loss"], abs=1e-5)
