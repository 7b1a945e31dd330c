"""A strategy added from outside hf_omni (tests/toy_strategy.py: FSDP2 with matrices on `Shard(1)`, registered with
`hf_omni.register_strategy` as `parallel: fsdp_dim1`) trains, checkpoints, resumes, exports with LoRA merged and reads
`empty_init` weights by columns, through the file I/O that serves any `Shard(dim)`. One launch at 2 gloo ranks
(tests/scripts/mp_toy_strategy.py) against one process (no process group: every module runs as it is) and against
the same run under `parallel: fsdp`."""

import pytest
import torch
import toy_strategy
from helpers import assert_state_close, full_state, make_args, step_losses, tiny_data, tiny_model
from toy_scenario import EMPTY_INIT_MODULES, LORA, modules

from hf_omni import OmniArgumentError, OmniTrainer, Projector, register_strategy
from hf_omni.parallel.strategy import STRATEGIES, Strategy
from hf_omni.shards.box import _chunk, local_box, shard_dims

ATOL = 1e-5


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory, launch_ranks):
    out = tmp_path_factory.mktemp("toy_strategy")
    launch_ranks("mp_toy_strategy.py", str(out))
    everyone = torch.load(out / "toy.pt", weights_only=False)
    return everyone[0] | {"_dir": out, "_ranks": everyone}


def one_process(tmp_path, model, module_settings, steps):
    trainer = OmniTrainer(model=model, args=make_args(tmp_path, modules=module_settings, max_steps=steps),
                          train_dataset=tiny_data(model, 48))
    trainer.train()
    return step_losses(trainer), full_state(model)


def test_box_cuts_as_torch_chunk_with_uneven_sizes():
    for size in range(10):
        for count in range(1, 6):
            parts = torch.arange(size).chunk(count) if size else ()
            for index in range(count):
                expected = parts[index].tolist() if index < len(parts) else []
                assert list(range(size))[_chunk(size, count, index)] == expected, (size, count, index)
    plain = torch.zeros(3, 2)
    assert local_box(plain) is None and shard_dims(plain) == {}


def test_register_strategy_checks_what_it_registers():
    assert STRATEGIES["fsdp_dim1"] is toy_strategy.ColumnShardStrategy
    assert register_strategy("fsdp_dim1", toy_strategy.ColumnShardStrategy) is toy_strategy.ColumnShardStrategy
    with pytest.raises(TypeError, match="subclass of .*Strategy"):
        register_strategy("not_one", dict)
    with pytest.raises(ValueError, match="`parallel: fsdp` is .*FsdpStrategy already"):
        register_strategy("fsdp", toy_strategy.ColumnShardStrategy)
    with pytest.raises(ValueError, match="identifier"):
        register_strategy("two words", toy_strategy.ColumnShardStrategy)


def test_a_name_registered_after_import_is_a_parallel_value(tmp_path):
    with pytest.raises(OmniArgumentError, match="late_toy"):
        make_args(tmp_path, modules={"llm": {"parallel": "late_toy"}})

    class Late(Strategy):
        pass

    register_strategy("late_toy", Late)
    try:
        assert Late.name == "late_toy"
        assert make_args(tmp_path, modules={"llm": {"parallel": "late_toy"}}).modules["llm"]["parallel"] == "late_toy"
    finally:
        del STRATEGIES["late_toy"]


def test_two_ranks_shard_columns(two_ranks):
    assert two_ranks["world_size"] == 2
    assert two_ranks["wrapped"] == {"vision": "fsdp_dim1", "projector": "fsdp_dim1", "llm": "fsdp_dim1"}
    for matrices in (*two_ranks["placements"].values(), two_ranks["empty_placements"]):  # every 2-D parameter
        assert matrices and set(matrices.values()) == {"(Shard(dim=1),)"}, matrices
    assert "model.layers.0.self_attn.q_proj.lora_B.default.weight" in two_ranks["placements"]["llm"]


def test_box_and_dim0_view_of_uneven_shards_at_two_ranks(two_ranks):
    assert {(shape, dim) for shape, dim, *_ in two_ranks["boxes"]} >= {((5, 3), 1), ((3, 1), 1), ((2, 5, 3), 2)}
    assert all(box and rows for _, _, box, rows in two_ranks["boxes"]), two_ranks["boxes"]


def test_replicas_of_a_column_shard_are_read_once(two_ranks):
    """Under HSDP-style replicas (a 2 x 1 mesh) one replica reads a `Shard(1)` tensor, the other receives it."""
    assert [r["replicas"]["read"] for r in two_ranks["_ranks"]] == [True, False]
    assert all(r["replicas"]["equal"] for r in two_ranks["_ranks"])


def test_two_ranks_equal_one_process_and_fsdp(two_ranks, tmp_path):
    losses, state = two_ranks["toy"]
    ref_losses, ref_state = one_process(tmp_path, tiny_model(), modules("fsdp_dim1"), steps=4)
    assert losses == pytest.approx(ref_losses, abs=ATOL)
    assert_state_close(state, ref_state, ATOL)
    fsdp_losses, fsdp_state = two_ranks["fsdp"]
    assert losses == pytest.approx(fsdp_losses, abs=ATOL)
    assert_state_close(state, fsdp_state, ATOL)


def test_resume_from_a_column_sharded_checkpoint_is_bitwise(two_ranks):
    losses, state = two_ranks["toy"]
    resumed_losses, resumed = two_ranks["resumed"]
    assert resumed_losses == losses
    assert resumed.keys() == state.keys()
    assert all(torch.equal(resumed[k], state[k]) for k in state), [k for k in state if not torch.equal(resumed[k],
                                                                                                          state[k])]


def test_export_merges_lora_from_column_shards(two_ranks):
    from transformers import LlamaForCausalLM

    _, state = two_ranks["toy"]
    llm = LlamaForCausalLM.from_pretrained(two_ranks["_dir"] / "export" / "llm").state_dict()
    scaling = LORA["lora_alpha"] / LORA["r"]
    for key, value in llm.items():
        stem = key.removesuffix(".weight")
        if f"llm.{stem}.base_layer.weight" in state:
            a, b = state[f"llm.{stem}.lora_A.default.weight"], state[f"llm.{stem}.lora_B.default.weight"]
            expected = state[f"llm.{stem}.base_layer.weight"] + (b @ a) * scaling
            assert torch.allclose(value, expected, atol=1e-6, rtol=0), key
        else:
            assert torch.equal(value, state[f"llm.{key}"]), key
    assert sum(".q_proj." in k or ".v_proj." in k for k in llm) == 2
    projector = Projector.from_pretrained(two_ranks["_dir"] / "export" / "projector").state_dict()
    assert all(torch.equal(v, state[f"projector.{k}"]) for k, v in projector.items())


def test_empty_init_reads_each_ranks_columns(two_ranks, tmp_path):
    reads = [(key, got, shape) for folder, key, got, shape in two_ranks["reads"] if folder == "llm"]
    matrices = [(key, got, shape) for key, got, shape in reads if len(shape) == 2]
    assert len(matrices) == 9, matrices  # embeddings, 4 attention, 3 MLP, lm_head
    assert all(got == (shape[0], shape[1] // 2) for _, got, shape in matrices), matrices
    losses, state = two_ranks["empty_init"]
    ref_losses, ref_state = one_process(tmp_path, tiny_model(), EMPTY_INIT_MODULES, steps=1)
    assert losses == pytest.approx(ref_losses, abs=ATOL)
    assert_state_close({k: state[k] for k in ref_state}, ref_state, ATOL)  # the reloaded ViT has a pooler too
