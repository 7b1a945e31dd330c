"""Master weights (`master_dtype`): a module loaded in bf16 and trained under bf16 compute keeps fp32 parameters
and fp32 optimizer state, computes in bf16, exports in bf16 and resumes bitwise from the fp32 masters kept in its
checkpoint's `state/`. The 2-rank FSDP cases (fp32 reductions, sharded masters resumed bitwise) are in
test_master_weights_multiprocess.py."""

import json
import logging
import struct

import pytest
import torch
from helpers import count_metadata_reads, make_args, reference_train, tiny_data, tiny_model
from real_model_runs import MATRIX, mismatches, straight_and_resumed

from hf_omni import OmniTrainer, OmniTrainingArguments
from hf_omni.core.errors import OmniArgumentError
from hf_omni.testing.digits import Captioner

LR, STEPS, BATCH = 1e-6, 3, 8


def safetensors_dtypes(path) -> dict[str, str]:
    """Each tensor's dtype as the file's header says."""
    with open(path, "rb") as f:
        header = json.loads(f.read(struct.unpack("<Q", f.read(8))[0]))
    return {k: v["dtype"] for k, v in header.items() if k != "__metadata__"}


@pytest.fixture(scope="module")
def bf16_folder(tmp_path_factory):
    """The demo model with its LLM saved in bf16 (a released LLM's files) beside fp32 vision and projector."""
    folder = tmp_path_factory.mktemp("bf16_llm")
    model = tiny_model()
    model.llm.to(torch.bfloat16)
    model.save_pretrained(folder)
    return folder


def q_proj(model):
    return model.llm.model.layers[0].self_attn.q_proj.weight


def train_bf16(folder, out, dtype=None, **overrides):
    model = Captioner.from_pretrained(folder, dtype=dtype)
    assert q_proj(model).dtype == torch.bfloat16
    before = q_proj(model).detach().float().clone()
    args = dict(bf16=True, learning_rate=LR, max_steps=STEPS, per_device_train_batch_size=BATCH,
                modules={"vision": {"trainable": False}})
    args.update(overrides)
    trainer = OmniTrainer(model=model, args=make_args(out, **args), train_dataset=tiny_data(model))
    trainer.train()
    moved = (q_proj(model).detach().float() != before).float().mean().item()
    return trainer, moved


def test_bf16_module_keeps_fp32_masters_equal_to_a_hand_written_loop(bf16_folder, tmp_path):
    """The issue's case: a bf16 LLM under `bf16: true` at a learning rate of 1e-6. Trained as loaded, bf16
    parameters keep only the updates larger than their spacing (a few percent of q_proj's elements move); with
    fp32 masters every element moves, exactly as a hand-written loop with an fp32 copy and bf16 autocast."""
    trainer, moved = train_bf16(bf16_folder, tmp_path / "omni")
    model = trainer.model
    llm_params = [p for p in model.llm.parameters() if p.requires_grad]
    assert {p.dtype for p in llm_params} == {torch.float32}
    state = trainer.optimizer.optimizers["llm"].state[q_proj(model)]
    assert state["exp_avg"].dtype == state["exp_avg_sq"].dtype == torch.float32
    assert moved > 0.99
    assert model.slots["llm"].precision.master == torch.float32
    assert model.slots["llm"].precision.compute == torch.bfloat16

    reference = Captioner.from_pretrained(bf16_folder)
    initial = {k: v.float().clone() for k, v in reference.state_dict().items()}
    reference.llm.float()  # the fp32 copy (exact: bf16 -> fp32)
    settings = {n: {"lr": LR, "max_norm": 1.0} for n in ("projector", "llm")}
    losses = reference_train(reference, tiny_data(reference), STEPS, BATCH, settings, autocast=torch.bfloat16)
    logged = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    assert logged == pytest.approx(losses, abs=1e-6)
    ours, theirs = model.state_dict(), reference.state_dict()
    for key in theirs:
        if key.startswith(("llm.", "projector.")) and theirs[key].is_floating_point():
            torch.testing.assert_close(ours[key] - initial[key], theirs[key] - initial[key], atol=1e-9, rtol=1e-3,
                                       msg=lambda m, key=key: f"{key}: {m}")


def test_pure_bf16_is_said_once_and_loses_small_updates(bf16_folder, tmp_path, caplog):
    """`master_dtype: bfloat16`: parameters and AdamW moments stay bf16, most updates round away, the log says
    so once for the module."""
    with caplog.at_level(logging.WARNING, logger="hf_omni"):
        trainer, moved = train_bf16(bf16_folder, tmp_path / "pure", modules={"vision": {"trainable": False},
                                                                            "llm": {"master_dtype": "bfloat16"}})
    assert q_proj(trainer.model).dtype == torch.bfloat16
    assert trainer.optimizer.optimizers["llm"].state[q_proj(trainer.model)]["exp_avg"].dtype == torch.bfloat16
    assert moved < 0.2
    said = [r.getMessage() for r in caplog.records if "updates smaller than their spacing" in r.getMessage()]
    assert len(said) == 1 and "'llm'" in said[0] and "master_dtype: bfloat16" in said[0]


def test_fp32_compute_keeps_the_loaded_dtype_and_float32_forces_masters(bf16_folder, tmp_path):
    """`auto` without lower-precision compute keeps a module as loaded (every module loaded in bf16 here, so that
    the composed forward runs without autocast); `float32` gives masters regardless."""
    trainer, _ = train_bf16(bf16_folder, tmp_path / "fp32_run", dtype=torch.bfloat16, bf16=False, max_steps=1)
    assert q_proj(trainer.model).dtype == torch.bfloat16
    assert trainer.model.slots["llm"].precision.master is None
    trainer, _ = train_bf16(bf16_folder, tmp_path / "forced", bf16=False, max_steps=1,
                            modules={"vision": {"trainable": False}, "llm": {"master_dtype": "float32"}})
    assert q_proj(trainer.model).dtype == torch.float32


def test_lora_adapters_follow_master_dtype_and_bases_keep_theirs(bf16_folder, tmp_path):
    lora = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]}
    for choice, adapter_dtype in (("auto", torch.float32), ("bfloat16", torch.bfloat16)):
        trainer, _ = train_bf16(bf16_folder, tmp_path / choice, max_steps=1, modules={
            "vision": {"trainable": False}, "llm": {"lora": lora, "master_dtype": choice}})
        layer = trainer.model.llm.model.layers[0].self_attn.q_proj
        assert layer.base_layer.weight.dtype == torch.bfloat16 and not layer.base_layer.weight.requires_grad
        assert layer.lora_A["default"].weight.dtype == adapter_dtype


def test_export_and_checkpoint_hold_the_loaded_dtype_and_the_masters(bf16_folder, tmp_path):
    """The checkpoint's HF folder and `save_model()` write bf16 (the masters rounded); the fp32 masters sit in
    `state/` beside the optimizer state; the live parameters stay fp32."""
    from safetensors.torch import load_file

    trainer, _ = train_bf16(bf16_folder, tmp_path / "run", save_strategy="steps", save_steps=STEPS)
    trainer.save_model(str(tmp_path / "export"))
    llm = trainer.model.llm
    masters = {k: v.detach().clone() for k, v in llm.state_dict().items()}
    for folder in (tmp_path / "export" / "llm", tmp_path / "run" / f"checkpoint-{STEPS}" / "llm"):
        assert set(safetensors_dtypes(folder / "model.safetensors").values()) == {"BF16"}
        written = load_file(str(folder / "model.safetensors"))
        key = "model.layers.0.self_attn.q_proj.weight"
        assert torch.equal(written[key], masters[key].to(torch.bfloat16))
    assert q_proj(trainer.model).dtype == torch.float32
    state = tmp_path / "run" / f"checkpoint-{STEPS}" / "llm" / "state"
    held = {}
    for shard in sorted(state.glob("*.safetensors")):
        held.update(safetensors_dtypes(shard))
    assert held["tensors.model.layers.0.self_attn.q_proj.weight"] == "F32"
    assert held["optimizer.state.model.layers.0.self_attn.q_proj.weight.exp_avg"] == "F32"
    reloaded = Captioner.from_pretrained(tmp_path / "export")
    assert q_proj(reloaded).dtype == torch.bfloat16


@pytest.mark.parametrize("case", ["llama_bf16", "mixtral_bf16_empty_init", "tied_bf16_empty_init"])
def test_bf16_modules_resume_bitwise_from_fp32_masters(tmp_path, case):
    """bf16 folders (every PEFT variant, MoE, tied embeddings, empty_init) trained under `bf16: true` at 1e-6:
    fp32 masters, and a resume from step 2 in a model with other weights ends bitwise equal to the straight run."""
    straight, final, resumed = straight_and_resumed(str(tmp_path), case, bf16=True, learning_rate=LR)
    assert mismatches(final, resumed) == []
    trained = {name for name, slot in straight.model.slots.items() if slot.trains}
    for name in trained:
        dtypes = {p.dtype for p in getattr(straight.model, name).parameters() if p.requires_grad}
        assert dtypes == {torch.float32}, (name, dtypes)
    assert any(straight.model.slots[n].precision.masters for n in trained)
    assert MATRIX[case][1] == torch.bfloat16


def test_a_checkpoint_without_masters_resumes_them_from_its_files(bf16_folder, tmp_path):
    """Pure-bf16 run saved, then resumed with fp32 masters: they start from the checkpoint's bf16 values."""
    first, _ = train_bf16(bf16_folder, tmp_path / "pure", max_steps=2, save_strategy="steps", save_steps=2,
                          modules={"vision": {"trainable": False}, "llm": {"master_dtype": "bfloat16"}})
    saved = q_proj(first.model).detach().clone()
    model = Captioner.from_pretrained(bf16_folder)
    args = make_args(tmp_path / "resumed", bf16=True, learning_rate=LR, max_steps=2, per_device_train_batch_size=BATCH,
                     modules={"vision": {"trainable": False}})
    trainer = OmniTrainer(model=model, args=args, train_dataset=tiny_data(model))
    trainer.train(resume_from_checkpoint=str(tmp_path / "pure" / "checkpoint-2"))  # no step left: weights only
    assert q_proj(model).dtype == torch.float32 and torch.equal(q_proj(model), saved.float())


def test_a_resume_reads_each_module_state_metadata_once(bf16_folder, tmp_path, monkeypatch):
    """A resume reads DCP's metadata of each trainable module's `state/` (all its shard headers; under a process
    group, rank 0 reads and broadcasts it) once, for every reader of it: the fp32 masters it holds, the optimizer
    state. (Before: once for the masters, again for the optimizer state.)"""
    first, _ = train_bf16(bf16_folder, tmp_path / "first", max_steps=2, save_strategy="steps", save_steps=2)
    assert first.model.slots["llm"].precision.masters
    reads = count_metadata_reads(monkeypatch, tmp_path / "first" / "checkpoint-2")
    model = Captioner.from_pretrained(bf16_folder)
    args = make_args(tmp_path / "resumed", bf16=True, learning_rate=LR, max_steps=3, per_device_train_batch_size=BATCH,
                     modules={"vision": {"trainable": False}})
    OmniTrainer(model=model, args=args, train_dataset=tiny_data(model)).train(
        resume_from_checkpoint=str(tmp_path / "first" / "checkpoint-2"))
    assert reads == {"llm/state": 1, "projector/state": 1}


def test_fp16_module_unscales_with_fp32_masters(tmp_path):
    """A module built in fp16 under fp16 compute: fp32 masters, so torch's GradScaler unscales its gradients
    (fp16 gradients fail: "Attempting to unscale FP16 gradients"). CPU: Accelerate's fp16 compute is a GPU path,
    so the scaler is torch's CPU GradScaler; Trainer's fp16 run stays a GPU check (bench/gpu_check.py)."""
    from accelerate import Accelerator

    from hf_omni import OmniPlugin

    model = tiny_model()
    model.llm.half()
    # first: TrainingArguments (inside the plugin) resets Accelerate's state
    plugin = OmniPlugin(modules={"vision": {"trainable": False}}, defaults={"learning_rate": 1e-3})
    accelerator = Accelerator(cpu=True, mixed_precision="fp16")
    accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    model, optimizer, scheduler = plugin.prepare(accelerator, model, num_training_steps=2)
    assert q_proj(model).dtype == torch.float32
    before = q_proj(model).detach().clone()
    batch = next(iter(torch.utils.data.DataLoader(tiny_data(model), batch_size=BATCH)))
    accelerator.scaler.scale(model(**batch).loss).backward()
    assert q_proj(model).grad.dtype == torch.float32
    plugin.clip_grad_norm_()  # unscales every module's gradients first
    optimizer.step()
    assert not torch.equal(q_proj(model), before)


def test_master_dtype_is_checked_before_any_compute():
    with pytest.raises(OmniArgumentError, match=r"modules\.llm\.master_dtype.*must be one of"):
        OmniTrainingArguments(output_dir="/tmp/unused", use_cpu=True, modules={"llm": {"master_dtype": "fp32"}})
    with pytest.raises(OmniArgumentError, match=r"master_dtype.*must be one of"):
        OmniTrainingArguments(output_dir="/tmp/unused", use_cpu=True, master_dtype="float16")


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory, launch_ranks):
    out = tmp_path_factory.mktemp("mp_master_weights")
    launch_ranks("mp_master_weights.py", str(out))
    return out, torch.load(out / "results.pt", weights_only=True)


def test_fsdp_gathers_in_bf16_and_reduces_in_fp32_at_two_ranks(two_ranks):
    """Under `bf16: true` the sharded LLM gathers bf16 parameters and reduce-scatters fp32 gradients, unset or
    with `mixed_precision: bf16` (whose Accelerate default reduced in bf16); a `reduce_dtype` the user writes is
    kept. Seen in the collectives' own dtypes, not only in the policy."""
    for rank in two_ranks[1]:
        policies = rank["policies"]
        for name in ("unset", "bf16"):
            assert policies[name]["param"] == "torch.bfloat16" and policies[name]["reduce"] == "torch.float32"
            assert ("all_gather", "torch.bfloat16") in policies[name]["collectives"]
            assert ("reduce_scatter", "torch.float32") in policies[name]["collectives"]
            assert ("reduce_scatter", "torch.bfloat16") not in policies[name]["collectives"]
        assert policies["dict"]["reduce"] == "torch.bfloat16"
        assert ("reduce_scatter", "torch.bfloat16") in policies["dict"]["collectives"]
        assert rank["shards"] == {"sharded": True, "local": "torch.float32", "exp_avg": "torch.float32"}


def test_sharded_masters_resume_bitwise_at_two_ranks_and_at_one(two_ranks, tmp_path):
    """The 2-rank run resumed from its step-2 checkpoint (empty_init, so every rank reads its rows of the bf16
    files, then its shards of the fp32 masters) ends bitwise equal; the same checkpoint resumed in one process
    holds exactly the step-2 masters (DCP reshards them); its HF folder is bf16."""
    out, ranks = two_ranks
    assert all(rank["resume_mismatch"] == [] for rank in ranks)
    metadata = [rank["metadata"] for rank in ranks]  # each state/: rank 0 reads its headers once, broadcasts once
    assert metadata[0]["reads"] == {"llm/state": 1, "projector/state": 1} and metadata[1]["reads"] == {}
    assert all(m["broadcasts"] == {"llm/state": 1, "projector/state": 1} for m in metadata)
    checkpoint = out / "straight" / "checkpoint-2"
    assert set(safetensors_dtypes(checkpoint / "llm" / "model.safetensors").values()) == {"BF16"}
    from accelerate import Accelerator

    from hf_omni import OmniPlugin

    model = Captioner.from_pretrained(out / "bf16_llm", empty_init=True)
    plugin = OmniPlugin(modules={"vision": {"trainable": False}}, defaults={"learning_rate": LR},
                        output_dir=str(tmp_path))
    filled = plugin.fill_from_checkpoint(model, str(checkpoint))
    plugin.prepare(Accelerator(cpu=True, mixed_precision="bf16"), model, num_training_steps=4)
    plugin.load_state(str(checkpoint), weights_loaded=filled)
    saved, ours = ranks[0]["at_save"], model.state_dict()
    llm_keys = [k for k in saved if k.startswith("llm.")]
    assert llm_keys and all(torch.equal(ours[k], saved[k]) for k in llm_keys)
    assert ours["llm.model.layers.0.self_attn.q_proj.weight"].dtype == torch.float32


def test_a_loaded_module_gets_its_fp32_masters_after_sharding(two_ranks):
    """The bf16 LLM loaded whole (no `empty_init`) and fully sharded over 2 ranks: each rank allocates fp32 masters
    for its own shards only (at most half the LLM's fp32 bytes plus one tensor, where a cast before sharding
    allocates all of them on every rank), and trains to the same state, bitwise, as the `empty_init` run whose files
    are read straight into the masters."""
    for rank in two_ranks[1]:
        loaded = rank["loaded"]
        assert 0 < loaded["master_bytes"] <= loaded["llm_bytes"] / 2 + loaded["largest"], loaded
        assert loaded["mismatch"] == [], loaded["mismatch"]
