"""A module format of the tests' own (`toy_format.py`: a plain torch module with a JSON config, one file and one
`register_module_format`) used as a module of a composed model: trained, checkpointed, resumed, exported and
rebuilt as a transformers module is, at 1 process and at 2 ranks (FSDP and DDP)."""

import os

import pytest
import torch
from helpers import assert_state_close, clone, reference_train
from launching import launch
from toy_format import ToyFormat, ToyNet
from toy_runs import MODULES, REFERENCE, ToyData, check_export, run, toy_model

import hf_omni
from hf_omni.formats.interface import FORMATS, format_of


def test_the_format_is_registered_first_and_refuses_other_classes():
    assert isinstance(FORMATS[0], ToyFormat) and isinstance(format_of(ToyNet), ToyFormat)
    assert format_of(toy_model().llm).name == "transformers"
    assert "register_module_format" in hf_omni.__all__ and "ModuleFormat" in hf_omni.__all__
    with pytest.raises(TypeError, match="register_module_format takes a ModuleFormat subclass"):
        hf_omni.register_module_format(ToyNet)
    with pytest.raises(ValueError, match="module 'x'.*PreTrainedModel"):
        hf_omni.OmniModel.from_modules({"x": torch.nn.Linear(2, 2)})


def test_toy_folder_loads_alone_and_through_the_composition(tmp_path):
    toy = toy_model().toy
    toy.save_folder(str(tmp_path / "alone"))
    assert all(torch.equal(a, b) for a, b in zip(ToyNet.from_folder(str(tmp_path / "alone")).state_dict().values(),
                                                 toy.state_dict().values()))


def one_process(tmp_path):
    """The run at 1 process (batch 8), once per test session."""
    if not hasattr(one_process, "result"):
        one_process.result = run(str(tmp_path / "single"), MODULES, batch=8)
    return one_process.result


def test_train_resume_export_rebuild_at_one_process(tmp_path):
    reference = clone(toy_model())
    result = one_process(tmp_path)
    ref_losses = reference_train(reference, ToyData(), steps=4, batch_size=8, settings=REFERENCE)
    assert result["losses"] == pytest.approx(ref_losses, abs=1e-5)
    assert_state_close(result["state"], {k: v for k, v in reference.state_dict().items()}, atol=1e-5)
    assert result["resumed_losses"] == result["losses"][-2:]  # resumed bitwise
    assert all(torch.equal(result["resumed_state"][k], v) for k, v in result["state"].items())
    check_export(str(tmp_path / "single" / "export"), result["state"])
    assert result["on_meta"]
    assert all(torch.equal(result["filled"][k], v) for k, v in result["state"].items())


def test_two_ranks_fsdp_and_ddp_equal_one_process(tmp_path):
    """At 2 ranks (batch 4 each): the toy module under FSDP, then under DDP (the LLM under DDP, then FSDP)."""
    single = one_process(tmp_path)
    launch("mp_toy_format.py", str(tmp_path / "multi"))
    for name in ("fsdp", "ddp"):
        result = torch.load(tmp_path / "multi" / f"{name}.pt", weights_only=False)
        assert result["losses"] == pytest.approx(single["losses"], abs=1e-5), name
        assert_state_close(result["state"], single["state"], atol=1e-5)
        assert result["resumed_losses"] == result["losses"][-2:]
        assert all(torch.equal(result["resumed_state"][k], v) for k, v in result["state"].items()), name
        assert result["on_meta"]
        assert all(torch.equal(result["filled"][k], v) for k, v in result["state"].items()), name
        sharded = "toy" if name == "fsdp" else "llm"
        assert set(result["sharded"][sharded]) == {"DTensor"}, result["sharded"]
        check_export(os.path.join(tmp_path, "multi", name, "export"), result["state"])
