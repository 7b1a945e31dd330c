"""Real modules at 2 gloo ranks (tests/scripts/mp_real_models.py, one launch): a trainable ViT whose pooler the
forward never uses trains under DDP (Trainer's find_unused_parameters default), BatchNorm buffers are rank 0's on
every rank (DDP's broadcast_buffers) so resume is bitwise on each rank, FSDP Mixtral (experts kept in state/)
resumes bitwise, and evaluate() at 2 ranks equals one process evaluating the export."""


import pytest
import torch
from helpers import make_args
from real_models import Batches, MultiEncoder
from scripts.mp_real_models import token_accuracy

from hf_omni import OmniTrainer


@pytest.fixture(scope="module")
def results(tmp_path_factory, launch_ranks):
    out = tmp_path_factory.mktemp("mp_real_models")
    launch_ranks("mp_real_models.py", str(out))
    return out, torch.load(out / "results.pt", weights_only=True)


@pytest.mark.parametrize("case", ["ddp", "fsdp"])
def test_resume_is_bitwise_on_every_rank(results, case):
    ranks = results[1][case]
    assert len(ranks) == 2
    for rank in ranks:
        assert rank["mismatch"] == []


def test_wrapping_and_ddp_defaults(results):
    ddp, fsdp = (results[1][case][0] for case in ("ddp", "fsdp"))
    assert ddp["wrapped"]["vit"] == "ddp" and ddp["wrapped"]["siglip"] == "none"
    assert all(ddp["ddp_find_unused"].values())  # Trainer's default for modules without activation checkpointing
    assert fsdp["wrapped"]["llm"] == "fsdp" and fsdp["wrapped"]["bert"] == "fsdp" and fsdp["wrapped"]["clip"] == "ddp"


@pytest.mark.parametrize("case", ["ddp", "fsdp"])
def test_evaluate_at_two_ranks_equals_one_process(results, tmp_path, case):
    out, got = results
    losses = [rank["eval_loss"] for rank in got[case]]
    assert losses[0] == losses[1]
    model = MultiEncoder.from_pretrained(out / case / "export")
    trainer = OmniTrainer(model=model, args=make_args(tmp_path, per_device_eval_batch_size=8),
                          compute_metrics=token_accuracy)
    one = trainer.evaluate(eval_dataset=Batches(16, seed=1))
    assert one["eval_loss"] == pytest.approx(losses[0], abs=1e-5)
    assert one["eval_accuracy"] == got[case][0]["eval_accuracy"]
    predictions = torch.as_tensor(trainer.predict(Batches(16, seed=1)).predictions)
    assert predictions.shape == got[case][0]["predictions"].shape
    assert (predictions - got[case][0]["predictions"]).abs().max().item() <= 1e-4
