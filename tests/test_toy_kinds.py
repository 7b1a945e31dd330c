"""A layout and a composition added from outside hf_omni, each one file plus one registration (tests/toy_layout.py:
`parallelism.toy_size`, a replicate dim; tests/toy_composition.py: a recipe kept beside the modules): their
declarations make the module's dimensions, mesh and refusals, and the composition's record and files; both train,
save, resume bitwise and export at 1 process and at 2 ranks (one launch, tests/scripts/mp_toy_kinds.py)."""

import json
import os

import pytest
import torch
from helpers import assert_state_close, make_args
from launching import launch
from toy_kinds import LAYOUT, PREFIX, RECIPE, RecipeCaptioner, layout_model, recipe_model, run
from toy_layout import ToyLayout

from hf_omni import OmniArgumentError
from hf_omni.files.composition import COMPOSITIONS, composition_of
from hf_omni.parallel.dims import ModuleDims
from hf_omni.parallel.layout import LAYOUTS

ATOL = 1e-5
KINDS = {"layout": (layout_model, LAYOUT), "recipe": (recipe_model, RECIPE)}


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    out = tmp_path_factory.mktemp("toy_kinds_single")
    return {name: run(str(out / name), build, modules, batch=8) | {"_dir": out / name}
            for name, (build, modules) in KINDS.items()}


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("toy_kinds_ranks")
    launch("mp_toy_kinds.py", str(out))
    return {name: torch.load(out / f"{name}.pt", weights_only=False) | {"_dir": out / name} for name in KINDS}


def test_the_layout_declares_its_dim_and_its_rules(tmp_path):
    assert LAYOUTS["toy"] is ToyLayout and ToyLayout.size_key == "toy_size"
    dims = ModuleDims.parse("llm", {"toy_size": 2, "dp_shard_size": 2}, 4)
    assert dims.names == ("toy", "dp_shard") and dims.shape == (2, 2)
    hsdp = ModuleDims.parse("llm", {"dp_replicate_size": 2, "toy_size": 2, "dp_shard_size": 2}, 8)
    assert hsdp.names == ("dp_replicate", "toy", "dp_shard") and hsdp.replicate_dims == ["dp_replicate", "toy"]
    with pytest.raises(OmniArgumentError, match=r"llm.*parallelism: dp_replicate_size x dp_shard_size x toy_size = "
                                                r"1 x 1 x 3 = 3, but the world size is 2"):
        ModuleDims.parse("llm", {"toy_size": 3}, 2)
    with pytest.raises(OmniArgumentError, match=r"llm.*parallelism\.toy_size.*needs `parallel: fsdp`"):
        make_args(tmp_path, modules={"llm": {"parallel": "ddp", "parallelism": {"toy_size": 2}}})
    with pytest.raises(OmniArgumentError, match=r"parallelism\.toy_size: toy replicas .* is per module"):
        make_args(tmp_path, parallel="fsdp", parallelism={"toy_size": 2})
    assert make_args(tmp_path, modules={"llm": {"parallel": "fsdp", "parallelism": {"toy_size": 2},
                                                "lora": {"r": 2, "target_modules": ["q_proj"]}}})  # LoRA composes


def test_fsdp2_shards_over_the_data_dims_with_the_layouts_replicate_dim_flattened():
    """Rank 0 of a fake world of 8 (no data moves): the module's mesh, and FSDP2's 2-D (replicate, shard) mesh with
    `dp_replicate` and `toy` flattened into one replicate dim."""
    import torch.distributed as dist

    from hf_omni.compat import init_fake_process_group
    from hf_omni.parallel.dims import Meshes

    init_fake_process_group(0, 8)
    try:
        dims = ModuleDims.parse("llm", {"dp_replicate_size": 2, "toy_size": 2, "dp_shard_size": 2}, 8)
        mesh = dims.mesh(Meshes("cpu"))
        data = dims.data_mesh(mesh)
        assert mesh.mesh_dim_names == ("dp_replicate", "toy", "dp_shard") and tuple(mesh.shape) == (2, 2, 2)
        assert data.mesh_dim_names == ("dp_replicate_toy", "dp_shard") and tuple(data.shape) == (4, 2)
        alone = ModuleDims.parse("llm", {"toy_size": 2, "dp_shard_size": 4}, 8)
        assert alone.data_mesh(alone.mesh(Meshes("cpu"))).mesh_dim_names == ("toy", "dp_shard")
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("name", list(KINDS))
def test_two_ranks_equal_one_process_and_resume_bitwise(single, two_ranks, name):
    one, two = single[name], two_ranks[name]
    assert two["losses"] == pytest.approx(one["losses"], abs=ATOL)
    assert_state_close(two["state"], one["state"], ATOL)
    for run_ in (one, two):  # resumed from step 2: the same last two steps, the same weights
        assert run_["resumed_losses"] == run_["losses"][-2:]
        assert all(torch.equal(run_["resumed_state"][k], v) for k, v in run_["state"].items())


def test_the_layout_replicates_over_its_dim_at_two_ranks(two_ranks):
    run_ = two_ranks["layout"]
    assert run_["wrapped"]["llm"] == "fsdp" and run_["mesh"]["llm"] == ("toy", "dp_shard")
    assert set(run_["placements"].values()) == {"(Replicate(), Shard(dim=0))"}, run_["placements"]


@pytest.mark.parametrize("name", list(KINDS))
def test_exports_load_back_equal(single, two_ranks, name):
    from transformers import LlamaForCausalLM

    for run_ in (single[name], two_ranks[name]):
        for export in ("export", "exported"):  # save_model, and `hf-omni export` of the last checkpoint
            llm = LlamaForCausalLM.from_pretrained(run_["_dir"] / export / "llm").state_dict()
            assert all(torch.equal(v, run_["state"][f"llm.{k}"]) for k, v in llm.items()), (name, export)


def test_the_composition_keeps_its_recipe_through_saves_checkpoints_and_exports(single, two_ranks):
    assert composition_of(recipe_model().config) is COMPOSITIONS["recipe"]
    assert composition_of(layout_model().config) is COMPOSITIONS["plain"]
    for run_ in (single["recipe"], two_ranks["recipe"]):
        folder = run_["_dir"]
        for where in ("run/checkpoint-2", "run/checkpoint-4", "export", "exported"):
            with open(folder / where / "recipe.json") as f:
                assert json.load(f) == {"prefix_ids": PREFIX}, where
            with open(folder / where / "config.json") as f:
                assert json.load(f)["recipe"] == {"file": "recipe.json"}, where
        loaded = RecipeCaptioner.from_pretrained(str(folder / "exported"))
        assert loaded.recipe == {"prefix_ids": PREFIX} and composition_of(loaded.config).name == "recipe"
        state = {k: v for k, v in loaded.state_dict().items()}
        assert all(torch.equal(state[k], v) for k, v in run_["state"].items()), "export loads back equal"
    assert not os.path.exists(single["layout"]["_dir"] / "export" / "recipe.json")
