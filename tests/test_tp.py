"""Tensor and expert parallelism per module (`parallelism: {dp_shard_size: S, tp_size: T}` / `{dp_shard_size: S,
ep_size: E}` on a `parallel: fsdp` module).

Launched (tests/scripts/mp_tp.py, tests/tp_scenarios.py; the 4-rank launch, then the 2-rank one): the tiny
captioner's Llama split by its transformers plan, or a Qwen2-MoE LLM with its experts spread, the rest of the model
data parallel, trained by OmniTrainer against one process on the same global batch: tp 2 (also with accumulation
windows and activation checkpointing; with tied embeddings; under bf16 with fp32 masters) and ep 2 at 2 ranks (with
accumulation and activation checkpointing),
dp_shard 2 x tp 2 and dp_shard 4 x ep 2 at 4 (experts clipped with the rest to one global norm). Losses and final
weights equal; the export (every rank its share) loads with the class's `from_pretrained` equal to the run's weights;
a run resumed from its checkpoint at the same layout ends bitwise as the run; resumed at another layout (dp_shard 2 x
tp 2 -> FSDP2 over 4 and over 2; dp_shard 4 x ep 2 -> ep 2 over 2) and in this one process it ends as the run; the
tp2 and ep2 exports rebuilt with `empty_init` at 2 ranks train as loaded whole in one process; the row boundary
alone on ragged rows (2 ranks). In process: the refusals (each names the module and `parallelism.tp_size` /
`parallelism.ep_size`), the split itself as one rank of a fake process group (tied weights), who writes a
tp-replicated tensor."""

import pytest
import torch
import tp_scenarios
from ema_runs import ema_state
from helpers import assert_state_close, full_state, make_args, step_losses, tiny_data, tiny_model
from transformers import LlamaConfig, LlamaForCausalLM

from hf_omni import OmniTrainer
from hf_omni.compat import init_fake_process_group
from hf_omni.core.errors import OmniArgumentError
from hf_omni.files.folder_write import tensor_mesh
from hf_omni.parallel.dims import dim_names, mesh_shape
from hf_omni.parallel.layout import layouts_for

TP2 = {"dp_shard_size": 1, "tp_size": 2}


@pytest.fixture(scope="module")
def launched(tmp_path_factory, launch_ranks):
    out = tmp_path_factory.mktemp("tp")
    launch_ranks("mp_tp.py", str(out), processes=4, timeout=300, env_extra={"OMP_NUM_THREADS": "1"})
    launch_ranks("mp_tp.py", str(out), processes=2, timeout=300, env_extra={"OMP_NUM_THREADS": "1"})
    return {"out": out, **{name: torch.load(out / f"{name}.pt", weights_only=True)
                           for name in [*tp_scenarios.SCENARIOS, *tp_scenarios.ELASTIC, "ragged",
                                        "empty_init_tp2", "empty_init_ep2", "empty_init_sp2", "sp_ragged",
                                        "sp_ragged_mqa"]}}


@pytest.mark.parametrize("name", list(tp_scenarios.SCENARIOS))
def test_tensor_parallel_llm_trains_as_one_process(launched, tmp_path, name):
    model = tp_scenarios.model(name)
    trainer = OmniTrainer(model=model, args=tp_scenarios.args(tmp_path, name, single=True),
                          train_dataset=tiny_data(model))
    trainer.train()
    got, atol = launched[name], TOLERANCE.get(name, 1e-5)
    assert got["losses"] == pytest.approx(step_losses(trainer), abs=atol)
    assert_state_close(got["state"], full_state(model), atol=atol)
    check_placements(name, got["placements"])
    assert got["dtypes"] == ["torch.float32"]  # bf16 compute: fp32 masters (split, spread experts too)
    assert got["managed"]  # transformers' generate on it runs with synced_gpus (ranks ending first keep joining)
    if name in tp_scenarios.EMA:  # the llm's EMA shadows: as one process's, resumed bitwise from the checkpoint
        shadows = ema_state(model)["llm"]["shadows"]
        assert_state_close(got["ema"]["llm"]["shadows"], shadows, atol=atol)
        assert_state_close(got["resumed_ema"]["llm"]["shadows"], got["ema"]["llm"]["shadows"], atol=0)
        assert got["ema"]["llm"]["step"] == 3
    assert got["checkpointing"] == ("_ac" in name or name == "ep2")
    assert got["save_async"] == tp_scenarios.save(name)["save_async"]  # checkpoint-2 by the writer thread
    # resumed from its checkpoint-2 at the same layout: the last step and the final weights as the run itself
    assert got["resumed_losses"] == got["losses"], (got["resumed_losses"], got["losses"])  # 2 logged, then step 3
    assert_state_close(got["resumed"], got["state"], atol=0)
    # elastic: its checkpoint-2 resumed in this one process (no tensor parallelism) ends as the multi-rank run
    resumed = tp_scenarios.model(name, seed=7)
    again = OmniTrainer(model=resumed, args=tp_scenarios.args(tmp_path / "resumed", name, single=True),
                        train_dataset=tiny_data(resumed))
    again.train(resume_from_checkpoint=str(launched["out"] / name / "checkpoint-2"))
    assert step_losses(again) == pytest.approx(got["losses"], abs=atol)
    assert_state_close(full_state(resumed), got["state"], atol=atol)
    # the export: every rank wrote its share of the llm's folder (column and row slices, tp-replicated norms once)
    exported = full_state(type(model.llm).from_pretrained(launched["out"] / name / "export" / "llm"))
    dtype = torch.bfloat16 if name in tp_scenarios.BF16 else torch.float32  # exported as loaded
    assert {v.dtype for v in exported.values()} == {dtype}
    assert_state_close(exported, {k[4:]: v.to(dtype) for k, v in got["state"].items() if k.startswith("llm.")}, atol=0)
    assert_state_close(exported, {k[4:]: v.to(dtype) for k, v in full_state(model).items() if k.startswith("llm.")},
                       atol=atol)
    if name in tp_scenarios.LORAS:  # merged row by row on the ranks holding the rows, as PEFT merges one process's
        check_merged(launched["out"] / name / "merged" / "llm", model.llm, atol)


def check_merged(folder, llm, atol: float) -> None:
    """The merged export holds plain weights equal to PEFT's own merge of the one-process run's adapters."""
    import copy

    from peft.tuners.lora import LoraLayer

    from hf_omni.lora.adapters import base_state_dict

    merged = copy.deepcopy(llm)
    layers = [m for m in merged.modules() if isinstance(m, LoraLayer)]
    assert len(layers) == 5 * llm.config.num_hidden_layers + 1  # q, v, o, up, down in each layer, and the LM head
    for layer in layers:
        layer.merge()
    expected = base_state_dict(dict(merged.state_dict()))
    loaded = full_state(type(llm).from_pretrained(folder))
    assert not any("lora" in k for k in loaded)
    assert_state_close(loaded, {k: v for k, v in expected.items() if k in loaded}, atol=atol)
    assert expected.keys() - loaded.keys() <= {"lm_head.weight"} - loaded.keys()


@pytest.mark.parametrize("name", list(tp_scenarios.GENERATE))
def test_generate_on_the_trained_split_llm_is_one_processs(launched, name):
    """The trained tp 2 / ep 2 llm's `generate` under OmniTrainer's wrapping, each rank on its own prompts (ep 2:
    rank 0 stops 3 tokens before rank 1), against the export loaded whole in one process on each rank's prompts."""
    got = torch.load(launched["out"] / f"{name}_generated.pt", weights_only=True)
    llm = tp_scenarios.RowLossCaptioner.from_pretrained(launched["out"] / name / "export").llm
    for rank, sequences in enumerate(got):
        expected = tp_scenarios.generate(llm, rank, name)
        assert sequences.shape == (2, 4 + tp_scenarios.GENERATE[name][rank])
        assert torch.equal(sequences, expected), (rank, sequences, expected)


@pytest.mark.parametrize("name", list(tp_scenarios.ELASTIC))
def test_tensor_parallel_checkpoint_resumes_at_another_layout(launched, name):
    """dp_shard 2 x tp 2 at 4 ranks -> FSDP2 over 4 ranks and over 2 without tensor parallelism; ep 2 over 4 ranks
    (experts sharded by FSDP2 inside their ranges) -> ep 2 over 2 (each expert whole on one rank): the same global
    batch, so the resumed run ends as the run it resumes."""
    source = launched[tp_scenarios.ELASTIC[name][1]]
    assert launched[name]["losses"] == pytest.approx(source["losses"], abs=1e-5)
    assert_state_close(launched[name]["state"], source["state"], atol=1e-5)
    check_placements(name, launched[name]["placements"])


TOLERANCE = {"tp2_bf16": 1e-2, "ep2_bf16": 1e-2, "sp2_bf16": 1e-2}  # bf16 compute: the split's sums round in another order than one process's


def check_placements(name: str, placements: dict) -> None:
    """The llm's parameters as the scenario's layout splits them: transformers' tensor-parallel plan under FSDP2
    over the dp dims of (dp_shard, tp); its expert-parallel plan under FSDP2 over (efsdp, ep); FSDP2 alone."""
    strided = "(_StridedShard(dim=0, sf=2), Shard(dim=0))"  # FSDP2's rows nested inside tp's / ep's
    if name in tp_scenarios.SEQUENCE:  # no weight split: FSDP2 over dp_shard x sp flattened
        layer = "model.layers.0.self_attn.q_proj." + ("base_layer." if name.endswith("lora") else "")
        assert placements[layer + "weight"] == "(Shard(dim=0),)"
    elif name == "dp2_tp2_ep2":  # attention split over tp, each rank's 3 experts sharded on dim 1 over efsdp 2, the
        # router a plain FSDP2 parameter over dp_shard 2
        assert placements["model.layers.0.self_attn.q_proj.weight"] == strided
        assert placements["model.layers.0.mlp.experts.gate_up_proj"] == "(Shard(dim=1), Shard(dim=0))"
        assert placements["model.layers.0.mlp.gate.weight"] == "(Shard(dim=0),)"
    elif name in tp_scenarios.MOE:
        replicas = "(Replicate(), " if name.startswith("hsdp") else "("  # HSDP: (dp_replicate, efsdp, ep)
        # 3 experts a rank over 2 efsdp ranks would pad: FSDP2 shards them on dim 1 inside the expert range
        on_columns = name in ("dp4_ep2", "dp4_ep2_lora")
        experts = "(Shard(dim=1), Shard(dim=0))" if on_columns else replicas + strided[1:]
        assert placements["model.layers.0.mlp.experts.gate_up_proj"] == experts
        assert placements["model.layers.0.mlp.experts.down_proj"] == experts
        router = "(Replicate(), Shard(dim=0))" if replicas[1:] else "(Shard(dim=1),)" if on_columns else \
            "(Shard(dim=0),)"  # the router: dense (its 6 rows over 4 ranks: on its columns)
        assert placements["model.layers.0.mlp.gate.weight"] == router
    elif name.startswith("dp2_tp2_to_"):
        assert placements["model.layers.0.self_attn.q_proj.weight"] == "(Shard(dim=0),)"
    elif name in tp_scenarios.LORAS:  # each adapter split like its base layer's style, the other a replica over tp
        layer = "model.layers.0.self_attn."
        assert placements[layer + "q_proj.base_layer.weight"] == strided
        assert placements[layer + "q_proj.lora_B.default.weight"] == strided  # its output rows, as q's
        assert placements[layer + "q_proj.lora_A.default.weight"] == "(Shard(dim=0),)"  # FSDP2 only
        assert placements[layer + "o_proj.base_layer.weight"] == "(Shard(dim=0), Shard(dim=1))"
        assert placements[layer + "o_proj.lora_A.default.weight"] == "(Shard(dim=0), Shard(dim=1))"  # its inputs
        assert placements[layer + "o_proj.lora_B.default.weight"] == "(Shard(dim=0),)"
        assert placements["lm_head.lora_B.default.weight"] == strided
    else:
        assert placements["model.layers.0.self_attn.q_proj.weight"] == strided
        assert placements["model.layers.0.self_attn.o_proj.weight"] == "(Shard(dim=0), Shard(dim=1))"
        assert placements["model.norm.weight"] == "(Shard(dim=0),)"  # no plan entry: a replica over tp


@pytest.mark.parametrize("name", ["tp2", "ep2", "sp2"])
def test_empty_init_split_module_reads_its_boxes(launched, tmp_path, name):
    """The tp2 / ep2 export rebuilt on meta (`empty_init`) at 2 ranks (split and sharded there, each rank reads its
    boxes: the experts its range) trains as that export loaded whole in one process."""
    got = launched["empty_init_" + name]
    model = tp_scenarios.RowLossCaptioner.from_pretrained(launched["out"] / name / "export")
    trainer = OmniTrainer(model=model, args=tp_scenarios.args(tmp_path, name, single=True),
                          train_dataset=tiny_data(model))
    trainer.train()
    assert got["on_meta"]
    assert got["losses"] == pytest.approx(step_losses(trainer), abs=1e-5)
    llm = lambda state: {k: v for k, v in state.items() if k.startswith("llm.")}  # ViT's pooler: not in the files
    assert_state_close(llm(got["state"]), llm(full_state(model)), atol=1e-5)


def test_ragged_rows_cross_the_boundary_exactly(launched):
    """Rank 0 runs 1 row, rank 1 runs 2 through one tp-2 Llama: loss, parameter and input gradients as one process.
    Then rank 1 alone calls it without rows: both ranks raise the same refusal, naming rank 1, and the next call runs
    on each rank's own rows again. `generate` on the same ragged prompts, greedy and sampled: one process's."""
    ranks = launched["ragged"]
    assert [r["rows"][0] for r in ranks] == [1, 2]
    assert ranks[0]["refused"] == ranks[1]["refused"] and "rank 1 of its tensor-parallel group called it with no row" \
        in ranks[0]["refused"] and "parallelism.tp_size" in ranks[0]["refused"], [r["refused"] for r in ranks]
    assert [r["rows_after"][0] for r in ranks] == [1, 2]
    assert [r["host_reads"] for r in ranks] == [[], []]  # row counts and shapes exchanged as host integers
    for r in ranks:
        assert r["loss"] < 1e-6 and r["params"] < 1e-7 and r["input"] < 1e-8, r
        # `generate` on the group's rows with its KV cache: each rank its own prompts' sequences, as one process
        assert r["greedy"].shape == (r["rows"][0], 10) and torch.equal(r["greedy"], r["expected_greedy"])
        assert torch.equal(r["sampled"], r["expected_sampled"])  # the first rank's seed, whatever the others'
        assert r["grad_scale"] > 1e-4  # the gradients compared are not all zero
    assert not torch.equal(ranks[1]["sampled"], ranks[1]["greedy"])  # sampling drew other tokens than greedy


@pytest.mark.parametrize("name", ["sp_ragged", "sp_ragged_mqa"])
def test_sequence_parallel_rows_of_other_lengths_cross_the_boundary_exactly(launched, name):
    """Rank 0 runs 1 row of 7 tokens, rank 1 2 rows of 5 through one sp-2 Llama (padded to 8, each rank attending
    over every position for 2 of the 4 heads; `_mqa`: one key/value head, repeated for both ranks): logits, the loss
    from shifted labels over Trainer's global count and every gradient as one process's. Rank 1's rows left-padded:
    logits at the tokens and the loss as one process's with the mask. A hole between tokens on one rank and
    `generate`, and a label on a left-padded row's first token: every rank raises the same refusal (at the first
    call with a mask; after it the problem is kept on the device, with no host read per call, until asked)."""
    ranks = launched[name]
    assert [r["shape"] for r in ranks] == [(1, 7, 19), (2, 5, 19)]  # each rank its own rows, whole
    for r in ranks:
        assert r["logits"] < 1e-5 and r["loss"] < 1e-6 and r["params"] < 2e-7, r
        assert r["grad_scale"] > 1e-4
    for r in ranks:
        assert r["left_padded_logits"] < 1e-5 and r["left_padded_loss"] < 1e-6, r
    assert ranks[0]["hole"] == ranks[1]["hole"] and "a hole between tokens" in ranks[0]["hole"] and \
        "parallelism.sp_size" in ranks[0]["hole"]
    assert ranks[0]["first_label"] == ranks[1]["first_label"]
    assert "a label on its first token" in ranks[0]["first_label"]
    for r in ranks:  # after the first call: no host read; a mask's problem kept on the device until asked
        assert r["host_reads"] == [], r["host_reads"]
        assert r["kept_hole"] == ranks[0]["hole"] and r["kept_first_label"] == ranks[0]["first_label"]
        assert r["kept_none"] is None
    assert all("`generate` of a sequence-parallel module is not supported" in r["generate"] for r in ranks)
    assert all("its loss is not transformers' causal-LM loss" in r["other_loss"] for r in ranks)


@pytest.mark.parametrize("entry, match", [
    ({"dp_shard_size": 1, "sp_size": 2, "tp_size": 2}, r"sequence parallelism \(Ulysses\) and tensor parallelism"),
    ({"dp_shard_size": 2, "sp_size": 2, "ep_size": 2}, r"sequence parallelism \(Ulysses\) and expert parallelism"),
])
def test_sequence_parallelism_with_another_layout_is_refused(entry, match):
    with pytest.raises(OmniArgumentError, match=rf"llm.*parallelism\.sp_size.*{match}"):
        mesh_shape("llm", entry, 4)


def test_video_transformer_at_two_data_by_two_sequence_ranks_equals_one_process(launched):
    """Wan's transformer sharded over dp_shard 2 x sp 2 (one row a rank; each sequence pair runs its two rows on 6 of
    the 12 tokens each), its blocks checkpointed, against diffusers' script loop at 1 process on the same batch of 4:
    losses, weights, the export loaded by WanPipeline alone and its sample."""
    from diffusers import WanPipeline
    from diffusion_runs import pipeline_state, reference
    from tiny_pipelines import sample

    ref_losses, ref_pipe = reference("wan")
    got = torch.load(launched["out"] / "wan_dp2_sp2.pt", weights_only=False)
    assert got["losses"] == pytest.approx(ref_losses, rel=1e-5)
    assert_state_close(got["state"], pipeline_state(ref_pipe), atol=1e-5)
    assert got["tokens"] and {shape[1] for shape in got["tokens"]} == {6}
    assert got["checkpointing"] == {"transformer": True, "text_encoder": False, "vae": False}
    assert torch.allclose(got["sample"], sample(ref_pipe), atol=1e-5)
    exported = sample(WanPipeline.from_pretrained(launched["out"] / "wan_dp2_sp2" / "export"))
    assert torch.allclose(exported, got["sample"], atol=1e-5)


@pytest.mark.parametrize("step, save", [(2, True), (3, False)])
def test_a_problem_a_boundary_kept_on_the_device_stops_the_next_checkpoint_or_the_end(tmp_path, step, save):
    """A split module's boundary keeps what it found after its first call on the device (a mask sequence
    parallelism cannot serve) and answers `hf_omni_pending_problem` when asked: found at step 2, the save of
    checkpoint-2 raises it before anything is written; found at the last step with no save after it, the end of the
    run raises it."""
    from transformers import TrainerCallback

    model = tiny_model()
    kept = []
    model.llm.hf_omni_pending_problem = lambda: kept.pop() if kept else None

    class Keep(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == step:
                kept.append("modules.llm.parallelism.sp_size: an attention_mask with a hole between tokens")

    trainer = OmniTrainer(model=model, args=make_args(tmp_path, max_steps=3, save_strategy="steps", save_steps=2),
                          train_dataset=tiny_data(model), callbacks=[Keep()])
    with pytest.raises(ValueError, match=r"modules\.llm\.parallelism\.sp_size: an attention_mask with a hole"):
        trainer.train()
    assert (tmp_path / "checkpoint-2").exists() is not save  # found before the save: nothing of it written


def test_sequence_layout_refuses_what_it_cannot_split():
    """Heads that sp does not divide; a module whose attention is not transformers' interface: refused by module and
    key before anything is split. An adopted model's module: its path holding attention takes it."""
    from released_models import BUILDERS, MODULES
    from transformers import ViTConfig, ViTModel

    from hf_omni import OmniModel

    sp = {"dp_shard_size": 1, "sp_size": 2}
    three = LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=24, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=3, num_key_value_heads=3))
    with pytest.raises(OmniArgumentError, match=r"llm.*parallelism\.sp_size.*3 attention heads.*Ulysses splits heads"):
        layouts_for("llm", sp)[0].check(three)
    six = LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=24, intermediate_size=32, num_hidden_layers=1,
                                       num_attention_heads=12, num_key_value_heads=3))
    with pytest.raises(OmniArgumentError, match=r"llm.*parallelism\.sp_size.*3 key/value heads.*4 ranks neither"):
        layouts_for("llm", {"dp_shard_size": 1, "sp_size": 4})[0].check(six)
    layouts_for("llm", {"dp_shard_size": 1, "sp_size": 3})[0].check(six)  # 3 divides 3: accepted
    from transformers import BertConfig, BertModel  # an encoder: padded positions would be attended

    bert = BertModel(BertConfig(vocab_size=32, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                intermediate_size=16))
    with pytest.raises(OmniArgumentError, match=r"llm.*parallelism\.sp_size.*BertModel has bidirectional attention"):
        layouts_for("llm", sp)[0].check(bert)
    vit = ViTModel(ViTConfig(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=16,
                             image_size=8, patch_size=4))
    vit.set_attn_implementation = None  # as a class that cannot set its attention implementation
    with pytest.raises(OmniArgumentError, match=r"llm.*parallelism\.sp_size.*reached neither through transformers' "
                                                r"attention interface nor through diffusers' context-parallel plan"):
        layouts_for("llm", sp)[0].check(vit)
    adopted = OmniModel.from_model(BUILDERS["llava"](), modules=MODULES["llava"])  # its language model, not lm_head
    assert [type(r).__name__ for r in layouts_for("llm", sp)[0].attended(adopted.llm)] == ["LlamaModel"]


def test_mesh_appends_the_tp_dim():
    assert mesh_shape("llm", TP2, 2) == (1, 2) and dim_names(TP2, 2) == ("dp_shard", "tp")
    three = {"dp_replicate_size": 2, "dp_shard_size": 2, "tp_size": 2}
    assert mesh_shape("llm", three, 8) == (2, 2, 2) and dim_names(three, 3) == ("dp_replicate", "dp_shard", "tp")
    assert dim_names({"dp_replicate_size": 2, "dp_shard_size": 2}, 2) == ("dp_replicate", "dp_shard")
    with pytest.raises(OmniArgumentError, match=r"llm.*parallelism.*1 x 1 x 2 = 2, but the world size is 4"):
        mesh_shape("llm", TP2, 4)


@pytest.mark.parametrize("modules, module", [
    ({"llm": {"parallel": "ddp", "parallelism": TP2}}, "llm"),
    ({"llm": {"parallel": "none", "parallelism": TP2}}, "llm"),
])
def test_refused_arguments_name_module_and_key(tmp_path, modules, module):
    model = tiny_model()
    with pytest.raises(OmniArgumentError, match=rf"{module}.*parallelism\.tp_size"):
        OmniTrainer(model=model, args=make_args(tmp_path, modules=modules), train_dataset=tiny_data(model))


@pytest.mark.parametrize("lora, match", [
    ({"lora_dropout": 0.1}, r"llm.*lora\.lora_dropout.*tensor parallelism \(tp_size\).*replicas would drift apart"),
    ({"use_dora": True}, r"llm.*lora\.use_dora.*DoRA's weight norm"),
])
def test_lora_settings_tensor_parallelism_cannot_serve_are_refused(tmp_path, lora, match):
    """Refused when the module's arguments are resolved, before anything is wrapped."""
    model = tiny_model()
    args = make_args(tmp_path, modules={"llm": {"parallel": "fsdp", "parallelism": TP2,
                                                "lora": {"r": 4, "target_modules": ["q_proj"], **lora}}})
    with pytest.raises(OmniArgumentError, match=match):
        OmniTrainer(model=model, args=args, train_dataset=tiny_data(model))


def test_lora_on_a_split_embedding_is_refused_by_name():
    """LoRA on the embeddings (split by rows) is no column- or row-wise Linear: refused naming the layer."""
    from peft import LoraConfig, inject_adapter_in_model

    llm = tp_scenarios.tp_model().llm
    inject_adapter_in_model(LoraConfig(r=2, target_modules=["embed_tokens", "q_proj"]), llm)
    with pytest.raises(OmniArgumentError, match=r"llm.*parallelism\.tp_size.*model\.embed_tokens is split "
                                                r"`embedding_rowwise`.*is Embedding"):
        layouts_for("llm", TP2)[0].check(llm)


EP2 = {"dp_shard_size": 2, "ep_size": 2}


@pytest.mark.parametrize("modules, match", [
    ({"llm": {"parallel": "ddp", "parallelism": EP2}}, r"llm.*parallelism\.ep_size.*needs `parallel: fsdp`"),
    ({"llm": {"parallel": "fsdp", "parallelism": {"dp_shard_size": 1, "tp_size": 4, "ep_size": 2}}},
     r"llm.*parallelism\.ep_size.*must be a multiple of tp_size = 4"),
    ({"llm": {"parallel": "fsdp", "parallelism": {"dp_shard_size": 3, "ep_size": 2}}},
     r"llm.*parallelism\.ep_size.*must divide dp_shard_size x tp_size = 3"),
])
def test_refused_expert_parallel_arguments(tmp_path, modules, match):
    with pytest.raises(OmniArgumentError, match=match):
        model = tiny_model()
        OmniTrainer(model=model, args=make_args(tmp_path, modules=modules), train_dataset=tiny_data(model))
    with pytest.raises(OmniArgumentError, match=r"parallelism\.ep_size.*per module"):
        make_args(tmp_path, parallel="fsdp", parallelism=EP2)


def test_lora_on_fused_experts_is_refused_by_name():
    """PEFT's `target_parameters` on the fused experts wraps the experts module (a `ParamWrapper`, one adapter block
    per expert): refused under ep_size, naming the module and `lora`; adapters on the dense layers compose."""
    from peft import LoraConfig, inject_adapter_in_model

    llm = tp_scenarios.tp_model(moe=True).llm
    inject_adapter_in_model(LoraConfig(r=2, target_modules=["q_proj"], target_parameters=["mlp.experts.gate_up_proj"]),
                            llm)
    with pytest.raises(OmniArgumentError, match=r"llm.*lora.*model\.layers\.0\.mlp\.experts is split "
                                                r"`ep_dispatch_experts`.*ParamWrapper"):
        layouts_for("llm", EP2)[0].check(llm)


def test_tensor_layout_refuses_styles_it_does_not_serve():
    """A MoE model under tp_size (its experts: ep_size), and a plan style hf_omni does not serve (Qwen3's norms
    `replicated_with_grad_allreduce`): refused by module and key."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    with pytest.raises(OmniArgumentError, match=r"llm.*parallelism\.tp_size.*Qwen2MoeForCausalLM is a MoE model.*"
                                                r"add ep_size"):
        layouts_for("llm", TP2)[0].check(tp_scenarios.tp_model(moe=True).llm)
    qwen3 = Qwen3ForCausalLM(Qwen3Config(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=2, head_dim=8))
    with pytest.raises(OmniArgumentError, match=r"llm.*parallelism\.tp_size.*as `replicated_with_grad_allreduce`"):
        layouts_for("llm", TP2)[0].check(qwen3)


def test_expert_layout_refuses_what_it_cannot_spread():
    """A module without an expert-parallel plan (a dense Llama), and experts that ep_size ranks cannot hold evenly,
    are refused by module and key before anything is split."""
    with pytest.raises(OmniArgumentError, match=r"llm.*parallelism\.ep_size.*LlamaForCausalLM has no expert-parallel"):
        layouts_for("llm", EP2)[0].check(tiny_model().llm)
    moe = tp_scenarios.tp_model(moe=True).llm  # 6 experts
    layouts_for("llm", EP2)[0].check(moe)
    with pytest.raises(OmniArgumentError, match=r"llm.*parallelism\.ep_size.*experts.gate_up_proj holds 6 experts, "
                                                r"which 4 ranks cannot hold evenly"):
        layouts_for("llm", {"dp_shard_size": 4, "ep_size": 4})[0].check(moe)


def test_tensor_parallelism_is_per_module_only(tmp_path):
    with pytest.raises(OmniArgumentError, match=r"parallelism\.tp_size.*per module"):
        make_args(tmp_path, parallel="fsdp", parallelism=TP2)
    with pytest.raises(OmniArgumentError, match=r"llm.*parallelism\.cp_size.*ring attention.*no CPU SDPA sharding "
                                                r"rule.*use sp_size"):
        make_args(tmp_path, modules={"llm": {"parallel": "fsdp", "parallelism": {"cp_size": 2}}})


def prepare_on_fake_rank(model, modules: dict, tmp_path, world: int = 2) -> None:
    """The driver's preparation of `model` as rank 0 of `world` (torch's fake process group: no data moves)."""
    import types

    import torch.distributed as dist

    from hf_omni import OmniPlugin
    from hf_omni.parallel.driver import prepare_modules
    from hf_omni.tuning.modes import apply_training_modes

    init_fake_process_group(0, world)
    try:
        OmniPlugin(modules=modules, output_dir=str(tmp_path)).resolve(model)
        apply_training_modes(model.slots)
        accelerator = types.SimpleNamespace(device=torch.device("cpu"), mixed_precision="no",
                                            prepare_model=lambda model, **kwargs: model)  # placement: none on CPU
        prepare_modules(accelerator, model, fsdp_scope="module")
    finally:
        dist.destroy_process_group()


def test_module_without_a_plan_is_refused_before_anything_is_wrapped(tmp_path):
    model = tiny_model()
    with pytest.raises(OmniArgumentError, match=r"projector.*parallelism\.tp_size.*Projector has no tensor-parallel"):
        prepare_on_fake_rank(model, {"vision": {"parallel": "fsdp"}, "projector": {"parallel": "fsdp",
                                                                                    "parallelism": TP2}}, tmp_path)
    assert type(model.vision).__name__ == "ViTModel"  # not wrapped, though it comes first
    with pytest.raises(OmniArgumentError, match=r"vision.*parallelism\.tp_size.*ViTModel has no tensor-parallel plan"):
        layouts_for("vision", TP2)[0].check(model.vision)
    layouts_for("llm", TP2)[0].check(model.llm)  # Llama has one


def on_fake_rank(body, world: int = 2):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    init_fake_process_group(0, world)
    try:
        body(init_device_mesh("cpu", (1, world), mesh_dim_names=("dp_shard", "tp")))
    finally:
        dist.destroy_process_group()


def test_tied_embeddings_are_split_once():
    torch.manual_seed(0)
    llm = LlamaForCausalLM(LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                       num_attention_heads=2, num_key_value_heads=2, vocab_size=24,
                                       tie_word_embeddings=True))
    full = llm.lm_head.weight.detach().clone()

    def split(mesh):
        layouts_for("llm", TP2)[0].apply(llm, mesh)
        assert llm.lm_head.weight is llm.model.embed_tokens.weight  # tied again after the split
        assert str(llm.lm_head.weight.placements) == "(Shard(dim=0),)"
        assert torch.equal(llm.lm_head.weight.to_local(), full[:12])  # rank 0's half of the vocab
        assert tensor_mesh(llm).mesh_dim_names == ("tp",)  # its writers' whole mesh (no FSDP here)

    on_fake_rank(split)


def test_boundary_keeps_rows_and_refuses_what_is_not_rows():
    import types

    from transformers.cache_utils import DynamicCache
    from transformers.modeling_outputs import CausalLMOutputWithPast

    from hf_omni.parallel.boundary import Boundary

    mesh = types.SimpleNamespace(get_group=lambda: None, get_local_rank=lambda: 1, size=lambda: 2)
    boundary = Boundary("llm", mesh, "parallelism.tp_size", "tensor-parallel", host=None)
    boundary.sizes = [1, 2]  # this rank (1) holds rows 1 and 2 of the group's 3
    logits = torch.randn(3, 4, 5)
    kept = boundary._keep(CausalLMOutputWithPast(logits=logits, hidden_states=(logits, logits + 1)), "output")
    assert torch.equal(kept.logits, logits[1:]) and torch.equal(kept.hidden_states[1], logits[1:] + 1)
    boundary.summed = True  # a loss over Trainer's global token count: a sum over the group's rows, 1/T a rank
    assert boundary._keep(CausalLMOutputWithPast(loss=torch.tensor(3.0), logits=logits), "output").loss == 1.5
    boundary.summed = False  # a mean over the group's rows: each rank's whole
    assert boundary._keep(CausalLMOutputWithPast(loss=torch.tensor(3.0), logits=logits), "output").loss == 3.0
    with pytest.raises(OmniArgumentError, match=r"llm.*parallelism\.tp_size.*its attentions \(2,\) is neither one"):
        boundary._keep({"attentions": torch.ones(2)}, "output")
    field = "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"  # 5.25 / 5.23
    with pytest.raises(OmniArgumentError, match=rf"llm.*its {field} is a DynamicCache.*use_cache=False"):
        boundary._keep(CausalLMOutputWithPast(logits=logits, **{field: DynamicCache()}), "output")


def test_tp_replicated_tensors_are_written_once_per_tp_group():
    """A norm on `(dp_shard,)` only is the same on every tp rank: the module's whole mesh makes tp a replica dim, so
    tp rank 0 of 2 writes its first half of the rows (rank 1 the rest); the split layers' shares are their boxes."""
    from torch.distributed.tensor import Shard, distribute_tensor

    from hf_omni.files.folder_derived import replica
    from hf_omni.files.folder_write import my_rows

    def check(mesh):
        norm = distribute_tensor(torch.arange(8.0), mesh["dp_shard"], [Shard(0)])
        assert replica(norm) == (0, 1) and replica(norm, mesh) == (0, 2)
        lo, hi, _, _ = my_rows(norm, 0, 2**21, full=mesh)
        assert (lo, hi) == (0, 4)

    on_fake_rank(check)


def moe_llm(family: str):
    """A tiny Mixtral / Qwen3-MoE / DeepSeek-V3 (4 fused experts each) with transformers' expert-parallel plan."""
    import transformers

    common = dict(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                  num_key_value_heads=2, num_experts_per_tok=2)
    config = {"mixtral": lambda: transformers.MixtralConfig(num_local_experts=4, **common),
              "qwen3_moe": lambda: transformers.Qwen3MoeConfig(num_experts=4, moe_intermediate_size=8, **common),
              "deepseek_v3": lambda: transformers.DeepseekV3Config(
                  n_routed_experts=4, n_shared_experts=1, moe_intermediate_size=8, first_k_dense_replace=0,
                  n_group=1, topk_group=1, kv_lora_rank=8, q_lora_rank=8, qk_rope_head_dim=4, qk_nope_head_dim=4,
                  v_head_dim=4, **common)}[family]()
    return transformers.AutoModelForCausalLM.from_config(config)


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe", "deepseek_v3"])
def test_experts_of_every_moe_family_are_spread(tmp_path, family):
    """Rank 0 of 2 (fake process group) at dp_shard 2 x ep 2: each family's fused experts split by its transformers
    plan, 2 whole experts on this rank, FSDP2's rows nested inside them; the router stays dense."""
    from hf_omni import OmniModel

    model = OmniModel.from_modules({"llm": moe_llm(family)})
    prepare_on_fake_rank(model, {"llm": {"parallel": "fsdp", "parallelism": EP2}}, tmp_path)
    mlp = model.llm.model.layers[0].mlp
    for name in ("gate_up_proj", "down_proj"):
        weight = getattr(mlp.experts, name)
        assert str(weight.placements) == "(_StridedShard(dim=0, sf=2), Shard(dim=0))", (name, weight.placements)
        assert weight.shape[0] == 4 and weight.to_local().shape[0] == 2
    assert mlp.experts.num_experts == 2  # the local count: the experts' forward skips the others' ids
    router = next(p for n, p in mlp.named_parameters() if "gate" in n and "experts" not in n and "proj" not in n)
    assert str(router.placements) == "(Shard(dim=0),)"


def test_experts_fewer_than_their_efsdp_ranks_are_sharded_on_a_dim_that_divides(tmp_path):
    """Rank 0 of 8 at dp_shard 8 x ep 4: each rank's one Mixtral expert (of 4) over 2 efsdp ranks would be padded to
    one whole expert a rank on dim 0; FSDP2 shards it on dim 1 instead, half of it on each."""
    from hf_omni import OmniModel

    model = OmniModel.from_modules({"llm": moe_llm("mixtral")})
    prepare_on_fake_rank(model, {"llm": {"parallel": "fsdp", "parallelism": {"dp_shard_size": 8, "ep_size": 4}}},
                         tmp_path, world=8)
    weight = model.llm.model.layers[0].mlp.experts.gate_up_proj  # [4, 64, 16]
    assert str(weight.placements) == "(Shard(dim=1), Shard(dim=0))"
    assert tuple(weight.to_local().shape) == (1, 32, 16)


@pytest.mark.parametrize("heads, kv, what", [(3, 3, "3 attention heads"), (4, 1, "1 key/value heads")])
def test_heads_tp_size_cannot_split_are_refused_before_any_compute(tmp_path, heads, kv, what):
    """3 attention heads, or 1 key/value head, at tp_size 2: refused by module and key when the arguments meet the
    model (`OmniTrainer(...)` / `OmniPlugin.resolve`, under a process group: rank 0 of a fake world of 2), not as a
    reshape error inside the first step."""
    import torch.distributed as dist

    from hf_omni import OmniPlugin
    from hf_omni.testing.digits import Captioner

    llm = LlamaForCausalLM(LlamaConfig(hidden_size=24, intermediate_size=32, num_hidden_layers=1, vocab_size=24,
                                       num_attention_heads=heads, num_key_value_heads=kv, head_dim=8))
    match = rf"llm.*parallelism\.tp_size.*{what}.*which 2 ranks cannot split evenly"
    with pytest.raises(OmniArgumentError, match=match):
        layouts_for("llm", TP2)[0].check(llm)
    base = tiny_model()
    model = Captioner.from_modules({**base.omni_modules(), "llm": llm}, processors=base.processors)
    init_fake_process_group(0, 2)
    try:
        with pytest.raises(OmniArgumentError, match=match):
            OmniPlugin(modules={"llm": {"parallel": "fsdp", "parallelism": TP2}}, output_dir=str(tmp_path)).resolve(model)
    finally:
        dist.destroy_process_group()
