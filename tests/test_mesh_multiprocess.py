"""Each module on its own device mesh: 4 gloo ranks (one `accelerate launch` runs every scenario) against 1 rank
with the same global batch. Elastic resume: a checkpoint saved under HSDP 2x2 at 4 ranks resumes at 2 ranks (every
module full shard) and in one process; the 2-rank run's own checkpoint resumes in one process."""

import pytest
import torch
from helpers import assert_state_close, full_state, make_args, step_losses, tiny_data, tiny_model
from mesh_scenarios import ELASTIC, SCENARIOS, build

from hf_omni import OmniTrainer


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory, launch_ranks):
    out = tmp_path_factory.mktemp("four_ranks")
    launch_ranks("mp_mesh.py", str(out), processes=4, timeout=900,
                 env_extra={"OMP_NUM_THREADS": "1"})  # 4 ranks on few cores
    return {name: torch.load(out / f"{name}.pt", weights_only=True) for name in SCENARIOS} | {"_dir": out}


def single_rank(tmp_path, name, **overrides):
    model, data, collator = build(SCENARIOS[name])
    args = make_args(tmp_path / name, **{**SCENARIOS[name]["single"], **overrides})
    trainer = OmniTrainer(model=model, args=args, train_dataset=data, data_collator=collator)
    return trainer, model


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_four_ranks_on_per_module_meshes_equal_one_rank(four_ranks, tmp_path, name):
    trainer, model = single_rank(tmp_path, name)
    trainer.train()
    got = four_ranks[name]
    assert got["facts"]["world_size"] == 4
    assert got["losses"] == pytest.approx(step_losses(trainer), abs=SCENARIOS[name]["atol"])
    assert_state_close(got["state"], full_state(model), atol=SCENARIOS[name]["atol"])


def test_meshes_are_what_each_module_asked_for(four_ranks):
    facts = four_ranks["mixed_global_clip"]["facts"]
    assert facts["mesh_shapes"] == {"vision": (4,), "projector": (2, 2), "llm": (2, 2)}
    assert facts["shared"]["llm"] == ["projector", "llm"]  # one mesh per shape, shared
    # the llm's first parameter, its 19-row embedding: dim 0 over a shard group of 2 pads 5.3%, so its columns
    assert facts["placements"]["llm"] == "(Replicate(), Shard(dim=1))"  # (hf_omni/parallel/placement.py)
    # HSDP 2x2: shards within ranks {0, 1} (a node of 2 processes), replicas across nodes (rank 0 with rank 2)
    assert facts["groups"]["llm"] == {"dp_replicate": [0, 2], "dp_shard": [0, 1]}
    assert facts["groups"]["vision"] == {"dp_shard": [0, 1, 2, 3]}
    for name, parts in (("vision", 4), ("llm", 2)):  # HSDP: each rank holds half the llm, a quarter of vision
        sharding = facts["sharding"][name]
        assert sharding["local_bytes"] == pytest.approx(sharding["full_bytes"] / parts, rel=0.2)  # rank 0: ceil rows
    model_scope = four_ranks["model_scope_hsdp"]["facts"]
    assert model_scope["mesh_shapes"] == {"(model)": (2, 2)}
    assert model_scope["placements"]["(model)"] == "(Replicate(), Shard(dim=2))"  # the ViT's [1, 1, 32] CLS token
    replicated = four_ranks["replicated_per_module_clip"]["facts"]
    assert replicated["wrapped"]["llm"] == "ddp" and "llm" not in replicated["mesh_shapes"]
    assert replicated["mesh_shapes"] == {"vision": (2, 2), "projector": (4,)}


def test_hsdp_checkpoint_resumes_in_one_process(four_ranks, tmp_path):
    """checkpoint-2 written at 4 ranks (vision full shard, projector and llm HSDP 2x2) resumes in one process and
    ends where the 4-rank run ended."""
    got = four_ranks["mixed_global_clip"]
    trainer, model = single_rank(tmp_path, "mixed_global_clip")
    trainer.train(resume_from_checkpoint=str(four_ranks["_dir"] / "mixed_global_clip" / "checkpoint-2"))
    assert step_losses(trainer) == pytest.approx(got["losses"], abs=1e-5)  # steps 1-2 from trainer_state.json
    assert_state_close(got["state"], full_state(model), atol=1e-5)


@pytest.fixture(scope="module")
def two_ranks_resumed(four_ranks, tmp_path_factory, launch_ranks):
    out = tmp_path_factory.mktemp("two_ranks_elastic")
    checkpoint = four_ranks["_dir"] / "mixed_global_clip" / "checkpoint-2"
    launch_ranks("mp_mesh.py", str(out), "elastic", str(checkpoint), processes=2, timeout=600)
    return torch.load(out / "elastic.pt", weights_only=True) | {"_dir": out}


def test_hsdp_checkpoint_resumes_at_two_ranks_full_shard_then_in_one_process(four_ranks, two_ranks_resumed,
                                                                             tmp_path):
    """4 ranks (HSDP 2x2) -> 2 ranks (full shard over 2) -> 1 process, each ending where the 4-rank run ended."""
    got = four_ranks["mixed_global_clip"]
    assert two_ranks_resumed["world_size"] == 2
    assert two_ranks_resumed["mesh_shapes"] == {"vision": (2,), "projector": (2,), "llm": (2,)}
    assert two_ranks_resumed["losses"] == pytest.approx(got["losses"], abs=1e-5)
    assert_state_close(got["state"], two_ranks_resumed["state"], atol=1e-5)
    model = tiny_model()
    trainer = OmniTrainer(model=model, args=make_args(tmp_path / "one", **dict(ELASTIC, per_device_train_batch_size=8)),
                          train_dataset=tiny_data(model))
    trainer.train(resume_from_checkpoint=str(two_ranks_resumed["_dir"] / "elastic" / "checkpoint-3"))
    assert step_losses(trainer) == pytest.approx(got["losses"], abs=1e-5)
    assert_state_close(got["state"], full_state(model), atol=1e-5)


def test_accumulation_keeps_sharded_gradients_sharded(four_ranks):
    """hsdp_accumulation (2 micro-steps a window): llm and projector (HSDP 2x2, `sync_each_batch` unset) hold their
    half of the gradients after every micro-step; vision (full shard over 4, `sync_each_batch: false`) holds its
    whole gradient inside the window and its quarter after the last micro-step. The losses equal one process without
    accumulation (`test_four_ranks_on_per_module_meshes_equal_one_rank`)."""
    facts = four_ranks["hsdp_accumulation"]["facts"]
    held, full = facts["held_gradients"], {n: s["full_bytes"] for n, s in facts["sharding"].items()}
    assert all(len(samples) == 8 for samples in held.values()), held  # 4 steps x 2 micro-steps
    for name in ("llm", "projector"):
        assert 0 < max(held[name]) <= 1.1 * full[name] / 2, (name, held[name], full[name])
    inside, last = held["vision"][0::2], held["vision"][1::2]
    assert min(inside) >= full["vision"], (inside, full["vision"])
    assert 0 < max(last) <= 0.3 * full["vision"], (last, full["vision"])  # a quarter, tiny rows padded to 4


def test_every_group_of_every_mesh_carries_ddp_timeout(four_ranks):
    """ddp_timeout 1234 s: the default group, hf_omni's side group and each mesh dim's group (HSDP's replicate and
    shard groups are new groups: without the timeout they would get gloo's 30 minutes)."""
    for name in SCENARIOS:
        timeouts = four_ranks[name]["facts"]["timeouts"]
        assert set(timeouts.values()) == {1234.0}, (name, timeouts)
    assert "llm.dp_replicate" in four_ranks["mixed_global_clip"]["facts"]["timeouts"]


@pytest.mark.parametrize("name", ["missing_modality", "missing_modality_accumulation", "missing_modality_offline",
                                  "missing_modality_tp", "missing_modality_ep", "missing_modality_sp"])
def test_the_missing_modality_exchange_is_one_all_gather_per_optimizer_step(four_ranks, name):
    """hf_omni's side group carries one collective per step: the window's exchange, agreed in `get_batch_samples`
    for all of its micro-batches (2 in missing_modality_accumulation, whose entry point is called at each); no
    exchange or agreement per forward or per entry-point call. The losses and weights equal one process
    (`test_four_ranks_on_per_module_meshes_equal_one_rank`)."""
    if name == "missing_modality_tp":  # the module some ranks lack input for: split over (dp_shard, tp)
        assert four_ranks[name]["facts"]["mesh_shapes"]["vision"] == (2, 2)
        assert four_ranks[name]["facts"]["placements"]["vision"] == "(_StridedShard(dim=0, sf=2), Shard(dim=0))"
    steps = four_ranks[name]["facts"]["side_collectives"]
    assert len(steps) == 4 and all(list(step.values()) == [1] for step in steps), steps
    assert all(next(iter(step)).startswith("all_gather") for step in steps), steps
