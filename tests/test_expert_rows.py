"""MoE experts under `empty_init`: a rank reads only the file tensors of the experts (rows of the fused tensors) it
holds, placed as transformers' own loading places them — traced from transformers' save-time conversion, for
Mixtral-style (w1 / w3 / w2 per expert) and Qwen2-MoE-style (gate / up / down per expert: DeepSeek-V3, OLMoE)
files, with no full copy of the module (`read_through_transformers` is not called)."""

import pytest
import torch
from transformers import (
    DeepseekV3Config, DeepseekV3ForCausalLM, MixtralConfig, MixtralForCausalLM, OlmoeConfig, OlmoeForCausalLM,
)

from hf_omni.files import weights
from hf_omni.files.empty_init import build_empty
from hf_omni.files import expert_rows
from hf_omni.files.expert_rows import read_rows, row_layout, slabs
from hf_omni.files.folder_plan import plan_folder
from hf_omni.files.saved_keys import module_tensors
from hf_omni.files.weights import SafetensorsIndex, fill_module
from hf_omni.shards.box import local_box

SMALL = dict(vocab_size=32, hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=2,
             num_key_value_heads=1)
CASES = {
    "mixtral": lambda: MixtralForCausalLM(MixtralConfig(**SMALL, num_local_experts=4, num_experts_per_tok=2)),
    "deepseek_v3": lambda: DeepseekV3ForCausalLM(DeepseekV3Config(
        **{**SMALL, "num_attention_heads": 2, "num_key_value_heads": 2}, moe_intermediate_size=8, n_routed_experts=4,
        num_experts_per_tok=2, n_group=1, topk_group=1, first_k_dense_replace=1, q_lora_rank=None, kv_lora_rank=8,
        qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=4)),
    "olmoe": lambda: OlmoeForCausalLM(OlmoeConfig(**SMALL, num_experts=4, num_experts_per_tok=2)),
}


@pytest.fixture(scope="module", params=list(CASES))
def saved(request, tmp_path_factory):
    torch.manual_seed(0)
    model = CASES[request.param]()
    folder = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(folder)
    return request.param, folder, type(model).from_pretrained(folder).state_dict()


def fused_names(module):
    plan = plan_folder(module)
    return plan, sorted({s for _, sources in plan.groups for s in sources})


def test_each_row_is_read_from_its_own_files(saved):
    kind, folder, loaded = saved
    module = build_empty(CASES[kind]().__class__, str(folder))
    plan, names = fused_names(module)
    assert names and all("experts" in n for n in names), names
    index = SafetensorsIndex.for_weights(str(folder))
    for name in names:
        layout = row_layout(module, plan, name)
        assert layout is not None, name
        full = loaded[name]
        for start, stop in ((0, 1), (1, 3), (3, 4)):  # a rank's experts
            rows = torch.full((stop - start, *full.shape[1:]), float("nan"), dtype=full.dtype)
            read_rows(rows, layout, index, (start, stop))
            assert torch.equal(rows, full[start:stop]), (kind, name, start)


class FakeMesh:
    """Rank `rank` of `count` on a 1-D mesh (no process group needed by `shards.box`)."""

    def __init__(self, rank, count):
        self.rank, self.count = rank, count

    def size(self, dim=None):
        return self.count

    def get_local_rank(self, dim=None):
        return self.rank


class Share:
    """Duck-typed DTensor: what rank `rank` of `count` holds of a tensor of `shape` sharded on `dim`."""

    def __init__(self, shape, dim, rank, count):
        from torch.distributed.tensor import Shard

        self.shape, self.ndim, self.placements = torch.Size(shape), len(shape), (Shard(dim),)
        self.device_mesh = FakeMesh(rank, count)
        self.local = torch.full([b.stop - b.start for b in local_box(self)], float("nan"))

    def to_local(self):
        return self.local


@pytest.mark.parametrize("slabbed", [True, False], ids=["slabs", "whole_rows"])
def test_experts_sharded_on_an_inner_dim_read_their_box_of_each_row(saved, slabbed, monkeypatch):
    """A fused experts tensor on `Shard(1)` / `Shard(2)` (3 ranks: uneven) keeps its box of each row: read from each
    file tensor's part in it (every file tensor here is a slab of the row: each element read once, by one rank), or,
    where they are not slabs, from the row's file tensors read whole by every rank."""
    kind, folder, loaded = saved
    module = build_empty(CASES[kind]().__class__, str(folder))
    plan, names = fused_names(module)
    index = SafetensorsIndex.for_weights(str(folder))
    assert all(slabs(row_layout(module, plan, n), index, loaded[n].shape[1:]) for n in names)
    if not slabbed:
        monkeypatch.setattr(expert_rows, "slabs", lambda *args: None)
    read, elements = index.read, []
    index.read = lambda key, box=None: elements.append(read(key, box).numel()) or read(key, box)
    for name in names:
        layout, full = row_layout(module, plan, name), loaded[name]
        for dim in range(1, full.ndim):
            elements.clear()
            for rank in range(3):
                share = Share(full.shape, dim, rank, 3)
                read_rows(share, layout, index)
                assert torch.equal(share.local, full[local_box(share)]), (kind, name, dim, rank)
            assert sum(elements) == (1 if slabbed else 3) * full.numel(), (kind, name, dim)


def test_fill_module_reads_experts_without_transformers_full_copy(saved, monkeypatch):
    kind, folder, loaded = saved

    def refuse(*args, **kwargs):
        raise AssertionError("a full copy through transformers' loading")

    monkeypatch.setattr(weights, "read_through_transformers", refuse)
    module = build_empty(CASES[kind]().__class__, str(folder))
    assert fill_module(module, str(folder), torch.device("cpu"), kind) == []
    for name, tensor in module_tensors(module).items():
        assert torch.equal(tensor, loaded[name]), (kind, name)


def test_a_conversion_that_is_not_row_by_row_is_left_to_transformers(saved):
    kind, folder, _ = saved
    module = build_empty(CASES[kind]().__class__, str(folder))
    plan, names = fused_names(module)
    plan.groups = [(k, sources) for k, sources in plan.groups if sources != [names[0]]]  # no group: no trace
    assert row_layout(module, plan, names[0]) is None
    assert row_layout(module, plan_folder(module), "lm_head.weight") is None  # written as is, not derived


def test_experts_the_files_lack_are_initialised_and_named(saved, tmp_path, caplog):
    """A folder without one layer's expert tensors (a partial or pruned checkpoint): those fused tensors are
    initialised with a warning naming them, as `from_pretrained` does, and everything else is read."""
    import logging

    from safetensors.torch import load_file, save_file

    kind, folder, loaded = saved
    module = build_empty(CASES[kind]().__class__, str(folder))
    _, names = fused_names(module)
    dropped = names[0]  # e.g. model.layers.0.mlp.experts.gate_up_proj: its per-expert file tensors removed
    layer = ".".join(dropped.split(".")[:3]) + "."  # model.layers.<i>.: every expert file tensor of that layer
    for path in folder.glob("*.safetensors"):
        kept = {k: v for k, v in load_file(path).items() if not (k.startswith(layer) and ".experts." in k)}
        save_file(kept, tmp_path / path.name, metadata={"format": "pt"})
    for path in folder.glob("*.json"):
        (tmp_path / path.name).write_text(path.read_text())
    with caplog.at_level(logging.WARNING, logger="hf_omni"):
        missing = fill_module(module, str(tmp_path), torch.device("cpu"), kind)
    lost = [n for n in names if n.startswith(layer)]
    assert sorted(missing) == sorted(lost) and dropped in missing
    assert any(dropped in r.getMessage() for r in caplog.records)
    for name, tensor in module_tensors(module).items():
        if name not in lost:
            assert torch.equal(tensor, loaded[name]), (kind, name)


def test_reading_through_transformers_is_refused_above_the_limit_for_whole_copies(saved, monkeypatch):
    """Experts the rows cannot serve go through transformers' own loading, a whole copy of the module on every rank:
    allowed up to `whole.WHOLE_COPY_LIMIT` bytes of module (then read as transformers loads them), refused above
    it before anything is loaded, naming the module, its size and what to use instead."""
    from hf_omni.files import whole

    kind, folder, loaded = saved
    monkeypatch.setattr(weights, "read_fused_rows", lambda module, folder, names, *rest: (names, []))  # rows cannot
    module = build_empty(CASES[kind]().__class__, str(folder))
    size = whole.module_bytes(module)
    monkeypatch.setattr(whole, "WHOLE_COPY_LIMIT", size - 1)
    loads = []
    monkeypatch.setattr(weights, "original_class", lambda module: loads.append(1) or type(module))
    with pytest.raises(ValueError) as refused:
        fill_module(module, str(folder), torch.device("cpu"), kind)
    message = str(refused.value)
    assert f"module {kind!r}" in message and "through transformers' loading" in message and loads == []
    assert f"({size / 2**30:.2f} GiB)" in message and "WHOLE_COPY_LIMIT" in message and "empty_init" in message
    monkeypatch.setattr(whole, "WHOLE_COPY_LIMIT", size)
    module = build_empty(CASES[kind]().__class__, str(folder))
    assert fill_module(module, str(folder), torch.device("cpu"), kind) == [] and loads == [1]
    for name, tensor in module_tensors(module).items():
        assert torch.equal(tensor, loaded[name]), (kind, name)
