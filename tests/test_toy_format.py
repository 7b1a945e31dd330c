"""A module format of the tests' own (`toy_format.py`: a plain torch module with a JSON config, one file and one
`register_module_format`) used as a module of a composed model: trained, checkpointed, resumed, exported and
rebuilt as a transformers module is, at 1 process and at 2 ranks (FSDP and DDP); its weights over several files
under its own names; pushed to a loopback Hub and loaded back by repo id."""

import os

import pytest
import torch
from helpers import assert_state_close, clone, reference_train
from launching import launch
from toy_format import ToyFormat, ToyNet
from toy_runs import MODULES, REFERENCE, ToyData, check_export, run, toy_model

import hf_omni
from hf_omni.files.format import FORMATS, format_of


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


def test_sharded_toy_folder_uses_the_formats_index_and_loads_every_way(tmp_path):
    """Weights over several files: the format's own shard and index names, read by ToyNet alone, by an eager
    load and by an empty_init build filled as training fills it."""
    from accelerate import Accelerator
    from toy_runs import ToyCaptioner

    model = toy_model()
    model.save_pretrained(str(tmp_path / "out"), max_shard_size=600)
    names = sorted(os.listdir(tmp_path / "out" / "toy"))
    assert names[0] == "toy_config.json" and names[-1] == "toy_weights.safetensors.index.json"
    assert len(names) > 3 and all(n.startswith("toy_weights-0000") for n in names[1:-1]), names
    state = model.state_dict()
    alone = ToyNet.from_folder(str(tmp_path / "out" / "toy"))
    assert all(torch.equal(v, state["toy." + k]) for k, v in alone.state_dict().items())
    eager = ToyCaptioner.from_pretrained(str(tmp_path / "out"))
    assert all(torch.equal(v, state[k]) for k, v in eager.state_dict().items())
    empty = ToyCaptioner.from_pretrained(str(tmp_path / "out"), empty_init=True)
    hf_omni.OmniPlugin(modules={"toy": {}, "llm": {"trainable": False}}, defaults={},
                       output_dir=str(tmp_path)).prepare_modules(Accelerator(cpu=True), empty)
    assert all(torch.equal(v, state[k]) for k, v in empty.state_dict().items())


def test_hub_push_and_load_back(tmp_path):
    """Per-module repos on a loopback Hub: the toy repo holds its own files and a card from its format; the
    composition loads back by repo id (the toy files downloaded by the format's names)."""
    import huggingface_hub
    import transformers.utils.hub
    from toy_runs import ToyCaptioner

    from hf_omni.testing import LoopbackHub

    model = toy_model()
    with LoopbackHub() as server, pytest.MonkeyPatch.context() as mp:
        for name, value in server.client_constants(str(tmp_path / "cache")).items():
            mp.setattr(huggingface_hub.constants, name, value)
        mp.delenv("HF_TOKEN", raising=False)
        mp.setattr(transformers.utils.hub, "_hf_api", None)
        model.push_to_hub("org/toycap")
        pushed = server.files("org/toycap-toy")
        assert {n for n in pushed if n not in ("README.md", ".gitattributes")} == {"toy_config.json",
                                                                                   "toy_weights.safetensors"}
        card = pushed["README.md"].decode()
        assert "ToyNet.from_folder" in card and "library_name" not in card.split("---")[1]
        loaded = ToyCaptioner.from_pretrained("org/toycap")
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in loaded.state_dict().items())


def test_activation_checkpointing_of_a_toy_module_is_refused_by_its_format(tmp_path):
    from accelerate import Accelerator

    plugin = hf_omni.OmniPlugin(modules={"toy": {"activation_checkpointing": True}}, defaults={},
                                output_dir=str(tmp_path))
    with pytest.raises(hf_omni.OmniArgumentError, match="ToyNet does not support activation checkpointing"):
        plugin.prepare_modules(Accelerator(cpu=True), toy_model())
