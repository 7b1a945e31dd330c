"""The entry point of a module on a rank whose batch has no input for it (hf_omni/missing_modality.py), in one
process with the cross-rank exchange stubbed: the dummy's 0 rows, BatchNorm statistics untouched, the module's
backward reached through the loss even when `forward` drops the rows, and the errors. The 4-rank runs against one
process are in tests/test_mesh_multiprocess.py."""

import pytest
import torch
from transformers import ResNetConfig, ResNetModel

import hf_omni.missing_modality as missing
from hf_omni import OmniModel, offline_encoder


class Tower(OmniModel):
    @offline_encoder(module="vision", inputs=["pixel_values", "mask"], output="features")
    def encode(self, pixel_values, mask):
        return self.vision(pixel_values=pixel_values * mask).pooler_output.flatten(1)

    def forward(self, pixel_values=None, mask=None, labels=None):
        feats = self.encode(pixel_values, mask=mask)
        if feats is None or not len(feats):  # drops the 0 rows: hf_omni still joins them to the loss
            return {"loss": torch.zeros((), requires_grad=True)}
        return {"loss": feats.square().mean()}


@pytest.fixture
def tower():
    torch.manual_seed(0)
    vision = ResNetModel(ResNetConfig(num_channels=1, embedding_size=8, hidden_sizes=[16], depths=[1],
                                      layer_type="basic"))
    return Tower.from_modules({"vision": vision}).train()


@pytest.fixture
def distributed(monkeypatch):
    """As if prepared over several ranks, another rank holding a batch of 3 images."""
    monkeypatch.setattr(missing, "runs_collectives", lambda model: True)
    donors = {"pixel_values": ((3, 1, 16, 16), torch.float32), "mask": ((3, 1, 1, 1), torch.bool)}
    monkeypatch.setattr(missing, "shared_shapes", lambda module, method, values: donors)


def test_a_rank_without_input_gets_0_rows_and_reaches_the_module_backward(tower, distributed):
    stats = {k: v.clone() for k, v in tower.state_dict().items() if "running" in k or "num_batches" in k}
    assert stats
    out = tower()
    feats = tower.encode(None, None)
    assert feats.shape == (0, 16) and feats.grad_fn is not None
    missing.PENDING.pop(tower)  # (the direct call above)
    for key, value in tower.state_dict().items():  # the dummy's batch statistics were put back
        if key in stats:
            assert torch.equal(value, stats[key]), key
    out["loss"].backward()
    assert out["loss"].item() == 0.0
    grads = [p.grad for p in tower.vision.parameters()]
    assert all(g is not None for g in grads)  # backward ran (its collectives would have)
    assert all(torch.count_nonzero(g) == 0 for g in grads)  # and contributed nothing


def test_no_rank_with_input_skips_the_module_everywhere(tower, monkeypatch):
    monkeypatch.setattr(missing, "runs_collectives", lambda model: True)
    monkeypatch.setattr(missing, "shared_shapes", lambda module, method, values: dict.fromkeys(values))
    assert tower.encode(None, None) is None and tower not in missing.PENDING


def test_one_process_runs_the_method_as_written(tower):
    assert tower.encode(None, None) is None
    assert tower.encode(torch.rand(2, 1, 16, 16), torch.ones(2, 1, 1, 1, dtype=torch.bool)).shape == (2, 16)


def test_inputs_partly_none_are_refused_naming_the_module(tower, distributed):
    with pytest.raises(ValueError, match=r"module 'vision': encode got \['pixel_values'\] but None for \['mask'\]"):
        tower.encode(torch.rand(2, 1, 16, 16), None)
