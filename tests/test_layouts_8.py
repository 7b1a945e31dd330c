"""HSDP with tensor or expert parallelism at 8 gloo ranks (tests/scripts/mp_layouts_8.py, one launch): the captioner's
Llama at `{dp_replicate_size: 2, dp_shard_size: 2, tp_size: 2}` (plain, and with LoRA on its column- and row-wise
layers) and at `{dp_replicate_size: 2, dp_shard_size: 2, sp_size: 2}`, a Qwen2-MoE LLM at `{dp_replicate_size: 2, dp_shard_size: 4, ep_size: 2}`; each rank its own 2 rows, against
one process on the same global batch of 16: losses and weights within 1e-5; resumed from the 8-rank checkpoint at
the same layout it ends bitwise as the run, and in this one process within 1e-5."""

import pytest
from helpers import assert_state_close, full_state, step_losses, tiny_data

from hf_omni import OmniTrainer
from scripts import mp_layouts_8 as layouts


@pytest.fixture(scope="module")
def launched(tmp_path_factory, launch_ranks):
    import torch

    out = tmp_path_factory.mktemp("layouts8")
    launch_ranks("mp_layouts_8.py", str(out), processes=8, timeout=600, env_extra={"OMP_NUM_THREADS": "1"})
    return {"out": out, **{name: torch.load(out / f"{name}.pt", weights_only=True) for name in layouts.LAYOUTS}}


@pytest.mark.parametrize("name", list(layouts.LAYOUTS))
def test_hsdp_with_a_layout_trains_as_one_process(launched, tmp_path, name):
    got = launched[name]
    model = layouts.model(name)
    trainer = OmniTrainer(model=model, args=layouts.args(tmp_path / "one", name, 1), train_dataset=tiny_data(model))
    trainer.train()
    assert got["losses"] == pytest.approx(step_losses(trainer), abs=1e-5)
    assert_state_close(got["state"], full_state(model), atol=1e-5)
    # resumed at 8 ranks from its checkpoint-2: the last step and the final weights bitwise as the run
    assert got["resumed_losses"] == got["losses"]
    assert_state_close(got["resumed"], got["state"], atol=0)
    # the 8-rank checkpoint resumed in one process ends as the run
    resumed = layouts.model(name, seed=7)
    again = OmniTrainer(model=resumed, args=layouts.args(tmp_path / "resumed", name, 1),
                        train_dataset=tiny_data(resumed))
    again.train(resume_from_checkpoint=str(launched["out"] / name / "checkpoint-2"))
    assert step_losses(again) == pytest.approx(got["losses"], abs=1e-5)
    assert_state_close(full_state(resumed), got["state"], atol=1e-5)
    placements = got["placements"]
    if name == "hsdp_sp":  # (dp_replicate, dp_shard x sp): replicated, FSDP2 over the 4 ranks of dp_shard x sp
        assert placements["model.layers.0.self_attn.q_proj.weight"] == "(Replicate(), Shard(dim=0))"
    elif name == "hsdp_ep":  # (dp_replicate, efsdp, ep): replicated, each pair of ranks sharding its 3 experts on dim 1
        assert placements["model.layers.0.mlp.experts.gate_up_proj"] == "(Replicate(), Shard(dim=1), Shard(dim=0))"
    else:  # (dp_replicate, dp_shard, tp): replicated, FSDP2's rows nested inside tp's
        q = "model.layers.0.self_attn.q_proj." + ("base_layer." if name.endswith("lora") else "")
        assert placements[q + "weight"] == "(Replicate(), _StridedShard(dim=0, sf=2), Shard(dim=0))"
        if name.endswith("lora"):  # its output rows split like q's
            assert placements["model.layers.0.self_attn.q_proj.lora_B.default.weight"] == placements[q + "weight"]
