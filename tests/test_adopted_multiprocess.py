"""Adopted released models at 2 gloo ranks (tests/scripts/mp_adopted.py, one launch) against one process on the
same global batches: LLaVA with its LLM tensor parallel (tp 2) or sequence parallel (sp 2), Qwen2.5-VL with its
carved-out projector sharded inside the sharded vision tower, the same with its LLM at sp 2 (3-D rotary positions,
rows of two widths left-padded), LLaVA with
a DDP projector between FSDP modules, Gemma3 with its tied `lm_head` left out of the mapping (taken into the
sharded LLM: one parameter with the embeddings), BLIP-2 with `query_tokens` (a parameter path) whole on every rank
beside the sharded Q-Former, mixed image / text-only rows under `group_by_modality` with accumulation;
the export written by both ranks loads with the released class; a batch with images on one rank only raises the
same error on every rank; Qwen2.5-VL built on the meta device from its released folder, each rank reading its own
rows. Each case also resumes from its step-2 checkpoint, bitwise on every rank, and at one process (elastic)."""

import os

import pytest
import torch
from released_models import collate
from helpers import full_state
from scripts.mp_adopted import BUILDERS_ALL, CASES, COLLATE, case_rows, case_trainer, run, tokens_only

KINDS = {"qwen2_5_vl": {"vision": "fsdp", "projector": "fsdp", "llm": "fsdp"},
         "llava": {"vision": "fsdp", "projector": "ddp", "llm": "fsdp"},
         "mixed": {"vision": "none", "projector": "ddp", "llm": "fsdp"},
         "offline": {"vision": "offline", "llm": "fsdp"},
         "paligemma": {"vision": "fsdp", "projector": "ddp", "llm": "fsdp"},
         "gemma3": {"vision": "fsdp", "projector": "ddp", "llm": "fsdp"},
         "blip2": {"vision": "fsdp", "qformer": "fsdp", "llm": "fsdp"},
         "llava_tp2": {"vision": "fsdp", "projector": "ddp", "llm": "fsdp"},
         "llava_sp2": {"vision": "fsdp", "projector": "ddp", "llm": "fsdp"},
         "qwen2_5_vl_sp2": {"vision": "fsdp", "projector": "fsdp", "llm": "fsdp"},
         "qwen2_5_omni": {"audio": "fsdp", "vision": "none", "llm": "fsdp", "talker": "fsdp", "token2wav": "none"},
         "qwen3_omni": {"audio": "fsdp", "vision": "none", "llm": "fsdp", "talker": "fsdp", "code2wav": "none"},
         "janus": {"vision": "fsdp", "vq": "none", "aligner": "ddp", "generation": "fsdp", "llm": "fsdp"},
         "empty_init": {"vision": "fsdp", "projector": "fsdp", "llm": "fsdp"}}


@pytest.fixture(scope="module")
def results(tmp_path_factory, launch_ranks):
    out = tmp_path_factory.mktemp("mp_adopted")
    launch_ranks("mp_adopted.py", str(out))
    return out, torch.load(out / "results.pt", weights_only=True)


@pytest.mark.parametrize("case", list(CASES))
def test_two_ranks_equal_one_process(results, tmp_path, case):
    out, got = results
    family, modules, extra = CASES[case]
    single = run(str(tmp_path), case, family, modules, extra, world=1)
    ranks = got[case]
    assert [r["kinds"] for r in ranks] == [KINDS[case]] * 2
    assert [r["mismatch"] for r in ranks] == [[], []]  # resumed from step 2: bitwise on every rank
    for rank in ranks:
        assert rank["losses"] == pytest.approx(single["losses"], abs=1e-5)
        assert (rank["logits"] - single["logits"]).abs().max().item() <= 1e-5
    state = ranks[0]["state"]
    assert state.keys() == single["state"].keys()
    for key, value in single["state"].items():
        assert (state[key] - value).abs().max().item() <= 1e-5, key
    if case == "gemma3":  # the head taken in stays the embeddings' one tensor through the FSDP wrap
        assert torch.equal(state["llm.lm_head.weight"], state["llm.model.language_model.embed_tokens.weight"])
    cls = type(BUILDERS_ALL[family]())
    exported = cls.from_pretrained(out / case / "export").eval()
    rows = case_rows(family, exported, extra)
    with torch.no_grad():
        batch = COLLATE.get(family, collate)([rows[i] for i in range(4)])
        if family in ("qwen2_5_omni", "qwen3_omni"):  # the release has no forward: its thinker's logits
            exported = exported.thinker
            batch = {k: v for k, v in batch.items() if k not in ("codec_ids", "speaker_token_ids")}
        if family == "janus":  # the release's forward reads; the understanding rows (and positions, as the step)
            batch = {k: v for k, v in batch.items() if not k.startswith("generation_")}
            mask = batch["attention_mask"]
            batch["position_ids"] = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)
        assert (tokens_only(exported(**batch).logits, batch) - single["logits"]).abs().max() <= 1e-5
    if family in ("qwen2_5_omni", "qwen3_omni", "janus"):  # both losses logged, adding up to the loss, equal on
        # both ranks
        for rank in ranks:
            assert [a + b for a, b in rank["parts"]] == pytest.approx(rank["losses"], abs=1e-5)
            assert sum(rank["parts"], []) == pytest.approx(sum(single["parts"], []), abs=1e-5)


@pytest.mark.parametrize("case", ["qwen2_5_vl", "llava", "llava_tp2", "llava_sp2", "qwen2_5_vl_sp2"])
def test_a_two_rank_checkpoint_resumes_at_one_process(results, tmp_path, case):
    """Elastic resume: the step-2 checkpoint the 2 ranks wrote (sharded and DDP modules), resumed by one process,
    ends where the uninterrupted one-process run ends."""
    out, _ = results
    family, modules, extra = CASES[case]
    single = run(str(tmp_path), case, family, modules, extra, world=1)
    elastic = case_trainer(str(tmp_path / "elastic"), family, modules, extra, 1, seed=7)
    elastic.train(resume_from_checkpoint=str(out / case / "checkpoint-2"))
    state = full_state(elastic.model)
    assert state.keys() == single["state"].keys()
    for key, value in single["state"].items():
        assert (state[key] - value).abs().max().item() <= 1e-5, key


def test_an_offline_module_is_read_back_for_the_export_by_the_main_process_alone(results):
    """Qwen2.5-VL's cached tower (on the meta device while training) is read from its source once per export, by
    the rank that writes it; the other rank reads nothing (the export's equality above checks what was written)."""
    reads = [rank["export_read"] for rank in results[1]["offline"]]
    assert reads[0] > 0 and reads[1] == 0, reads
    assert [rank["export_read"] for rank in results[1]["llava"]] == [0, 0]


def test_empty_init_reads_each_byte_of_the_released_files_once(results):
    """Every module sharded: the two ranks' reads of the released files add up to the file's tensors, each rank
    about half (its own rows; no rank reads a whole module)."""
    out, got = results
    from safetensors import safe_open

    with safe_open(os.path.join(out, "empty_init", "released-qwen2_5_vl", "model.safetensors"), "pt") as f:
        total = sum(f.get_tensor(k).numel() * f.get_tensor(k).element_size() for k in f.keys())
    reads = [rank["read"] for rank in got["empty_init"]]
    assert sum(reads) == total
    assert max(reads) <= 0.55 * total


def test_images_on_one_rank_only_raise_the_same_error_on_every_rank(results):
    errors = results[1]["lacking"]
    assert errors[0] is not None and errors[0] == errors[1]
    assert "['pixel_values'] given on ranks [0] but not on ranks [1]" in errors[0]
    assert "group_by_modality: true" in errors[0] and "['vision', 'projector']" in errors[0]
