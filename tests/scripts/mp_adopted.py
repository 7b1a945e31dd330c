"""Adopted released models at 2 gloo ranks, one launch for all (tests/test_adopted_multiprocess.py compares each
with one process on the same global batches). Usage: mp_adopted.py OUT_DIR

- qwen2_5_vl: vision frozen under FSDP, its carved-out projector (`model.visual.merger`) trained under its own FSDP
  unit inside the vision root, LoRA LLM under FSDP;
- llava: vision frozen under FSDP, projector under DDP, LoRA LLM under FSDP with activation checkpointing (its
  release's own; equal to without at one process: test_adopted_checkpointing.py); exported at 2 ranks;
- paligemma: the same mapping and wrapping, its `lm_head` tied to the LLM's embeddings inside the llm module;
- gemma3: its tied `lm_head` left out of the mapping (taken into the llm module), the LLM trained fully under FSDP;
- blip2: the Q-Former module under FSDP with `query_tokens` (a parameter of the root model: kept whole on every rank)
  and the projection, LoRA OPT under FSDP;
- mixed: LLaVA rows with and without images, `group_by_modality: true`, 2 accumulation micro-steps;
- each case saved at step 2 and resumed from there (another seed) at 2 ranks;
- offline: Qwen2.5-VL's `get_image_features` (tower + merger, one frozen module) served from the offline cache
  (encoded by both ranks), mixed resolutions, rank 1's first batch without images (no group_by_modality: only the
  cached module reads them), LoRA LLM under FSDP;
- llava_tp2: LLaVA with its LLM (`model.language_model` and `lm_head`) tensor parallel over the 2 ranks (the
  released model's plan), each rank's own rows crossing its boundary;
- llava_sp2: the same with its LLM sequence parallel over the 2 ranks (its language model's attention wrapped, each
  rank running both ranks' rows on half the positions; `lm_head` and the released forward's loss on whole rows);
- empty_init: Qwen2.5-VL from its released folder on the meta device (`from_model(cls, folder, empty_init=True)`),
  every module sharded, each rank reading its own rows of the released files (LLM trained fully: a fresh LoRA's
  draw differs per shard under empty_init);
- qwen2_5_omni: Qwen2.5-Omni's thinker (LoRA LLM under FSDP, audio tower frozen under FSDP, vision tower frozen)
  and talker (trained fully under FSDP) trained jointly from rows of text, image and audio prompts with speech codes
  (`adopt/omni/qwen2_5_omni.py`'s step), token2wav frozen and never wrapped; its codec loss normalised over both
  ranks' codes;
- qwen3_omni: Qwen3-Omni-MoE the same way, its thinker's MoE LLM with its experts spread over the 2 ranks
  (`ep_size: 2`, LoRA on the attention), the talker and its code predictor under FSDP (every codebook's loss);
- janus: Janus' understanding rows and image generation rows in every batch (`adopt/omni/janus.py`'s step), the
  vision tower frozen under FSDP, the VQ model frozen, the aligner under DDP, the generation heads under FSDP, LoRA
  language model under FSDP;
- lacking: rank 0's batch has images, rank 1's has none: every rank raises the same error.
"""

import os
import sys

import torch
import torch.distributed as dist
from helpers import full_state, make_args
from launching import end_distributed
from omni_models import (
    JANUS, QWEN2_5_OMNI, QWEN3_OMNI, JanusRows, OmniRows, Qwen3OmniRows, janus, janus_collate, qwen2_5_omni, qwen3_omni,
)
from omni_models import collate as omni_collate
from released_models import BUILDERS, BUILT, MODULES, TIED_OUTSIDE, Rows, collate

from hf_omni import OmniModel, OmniTrainer
from hf_omni.testing.reads import count_reads

READ = {"bytes": 0}  # in a launch: bytes hf_omni's safetensors reader requests (the empty_init case's files)

LORA = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]}
CASES = {
    "qwen2_5_vl": ("qwen2_5_vl", {"vision": {"trainable": False, "parallel": "fsdp"},
                                  "projector": {"learning_rate": 1e-2, "parallel": "fsdp"},
                                  "llm": {"lora": LORA, "learning_rate": 1e-3, "parallel": "fsdp"}}, {}),
    "llava": ("llava", {"vision": {"trainable": False, "parallel": "fsdp"},
                        "projector": {"learning_rate": 1e-2, "parallel": "ddp"},
                        "llm": {"lora": LORA, "learning_rate": 1e-3, "parallel": "fsdp",
                                "activation_checkpointing": True}}, {}),
    "mixed": ("llava", {"vision": {"trainable": False}, "projector": {"learning_rate": 1e-2, "parallel": "ddp"},
                        "llm": {"lora": LORA, "learning_rate": 1e-3, "parallel": "fsdp"}},
              dict(group_by_modality=True, gradient_accumulation_steps=2, global_batch=4, text_only_every=3)),
    "offline": ("qwen2_5_vl", {"vision": {"trainable": False, "offline_encoder": "get_image_features"},
                               "llm": {"lora": LORA, "learning_rate": 1e-3, "parallel": "fsdp"}},
                dict(mapping={"vision": "model.visual", "llm": ["model.language_model", "lm_head"]}, offline=True,
                     wide_every=2, text_only_rows=[4, 5, 6, 7])),
    "paligemma": ("paligemma", {"vision": {"trainable": False, "parallel": "fsdp"},
                                "projector": {"learning_rate": 1e-2, "parallel": "ddp"},
                                "llm": {"lora": LORA, "learning_rate": 1e-3, "parallel": "fsdp"}}, {}),
    "gemma3": ("gemma3", {"vision": {"trainable": False, "parallel": "fsdp"},
                          "projector": {"learning_rate": 1e-2, "parallel": "ddp"},
                          "llm": {"learning_rate": 1e-3, "parallel": "fsdp"}}, dict(mapping=TIED_OUTSIDE)),
    "blip2": ("blip2", {"vision": {"trainable": False, "parallel": "fsdp"},
                        "qformer": {"learning_rate": 1e-2, "parallel": "fsdp"},
                        "llm": {"lora": LORA, "learning_rate": 1e-3, "parallel": "fsdp"}}, {}),
    "llava_tp2": ("llava", {"vision": {"trainable": False, "parallel": "fsdp"},
                            "projector": {"learning_rate": 1e-2, "parallel": "ddp"},
                            "llm": {"learning_rate": 1e-3, "parallel": "fsdp",
                                    "parallelism": {"dp_shard_size": 1, "tp_size": 2}}}, {}),
    "llava_sp2": ("llava", {"vision": {"trainable": False, "parallel": "fsdp"},
                            "projector": {"learning_rate": 1e-2, "parallel": "ddp"},
                            "llm": {"learning_rate": 1e-3, "parallel": "fsdp",
                                    "parallelism": {"dp_shard_size": 1, "sp_size": 2}}}, {}),
    "qwen2_5_vl_sp2": ("qwen2_5_vl", {"vision": {"trainable": False, "parallel": "fsdp"},  # Adam at 1e-2 moved
                                      "projector": {"learning_rate": 1e-3, "parallel": "fsdp"},  # one ~0 gradient's
                                      # weight 1.4e-5 off (the split's other summation order); the rest <= 1.6e-6
                                      "llm": {"learning_rate": 1e-3, "parallel": "fsdp",
                                              "parallelism": {"dp_shard_size": 1, "sp_size": 2}}},
                       dict(mrope=True, wide_every=3)),  # the processor's token types: 3-D rotary positions;
    # every third image twice as wide: rows of other lengths on each rank, left-padded by the collator
    "qwen2_5_omni": ("qwen2_5_omni", {"audio": {"trainable": False, "parallel": "fsdp"}, "vision": {"trainable": False},
                                      "llm": {"lora": LORA, "learning_rate": 1e-3, "parallel": "fsdp"},
                                      "talker": {"learning_rate": 1e-3, "parallel": "fsdp"},
                                      "token2wav": {"trainable": False}}, dict(mapping=QWEN2_5_OMNI)),
    "qwen3_omni": ("qwen3_omni", {"audio": {"trainable": False, "parallel": "fsdp"}, "vision": {"trainable": False},
                                  "llm": {"lora": LORA, "learning_rate": 1e-3, "parallel": "fsdp",
                                          "parallelism": {"dp_shard_size": 2, "ep_size": 2}},
                                  "talker": {"learning_rate": 1e-3, "parallel": "fsdp"},
                                  "code2wav": {"trainable": False}}, dict(mapping=QWEN3_OMNI)),
    "janus": ("janus", {"vision": {"trainable": False, "parallel": "fsdp"}, "vq": {"trainable": False},
                        "aligner": {"learning_rate": 1e-2, "parallel": "ddp"},
                        "generation": {"learning_rate": 1e-2, "parallel": "fsdp"},
                        "llm": {"lora": LORA, "learning_rate": 1e-3, "parallel": "fsdp"}}, dict(mapping=JANUS)),
    "empty_init": ("qwen2_5_vl", {"vision": {"trainable": False, "parallel": "fsdp"},
                                  "projector": {"learning_rate": 1e-2, "parallel": "fsdp"},
                                  "llm": {"learning_rate": 1e-3, "parallel": "fsdp"}}, dict(empty_init=True)),
}


def released_folder(out_dir: str, family: str) -> str:
    """The family's tiny model saved once as a released checkpoint (rank 0 writes; the others wait)."""
    folder = os.path.join(out_dir, f"released-{family}")
    if int(os.environ.get("RANK", "0")) == 0 and not os.path.isdir(folder):
        BUILDERS[family]().save_pretrained(folder)
    if dist.is_initialized():
        dist.barrier()
    return folder


BUILDERS_ALL = {**BUILT, "qwen2_5_omni": qwen2_5_omni, "janus": janus, "qwen3_omni": qwen3_omni}
COLLATE = {"qwen2_5_omni": omni_collate, "janus": janus_collate, "qwen3_omni": omni_collate}
PARTS = {"qwen2_5_omni": ("llm", "talker"), "janus": ("llm", "generation"),  # each loss's module
         "qwen3_omni": ("llm", "talker")}
ROW_KEYS = ("text_only_every", "wide_every", "text_only_rows", "mrope")


def case_rows(family: str, model, extra: dict) -> Rows:
    """A case's 32 rows: every k-th text-only, every k-th wide (Qwen2.5-VL), and the listed rows text-only, 15
    tokens long (the widest image row's length: Qwen2.5-VL's loss on a text row depends on its left padding, so a
    rank's batch of these must pad as the one-process batch does)."""
    if family == "qwen2_5_omni":
        return OmniRows(32)
    if family == "janus":
        return JanusRows(32)
    if family == "qwen3_omni":
        return Qwen3OmniRows(32)
    rows = Rows(family, model, 32, text_only_every=extra.get("text_only_every", 0),
                wide_every=extra.get("wide_every", 0), mrope=extra.get("mrope", False))
    for i in extra.get("text_only_rows", []):
        ids = torch.cat([torch.arange(2, 11), rows.rows[i]["input_ids"][-6:]])
        rows.rows[i] = {"input_ids": ids, "labels": ids.clone()}
        rows.modalities[i] = []
    return rows


def case_trainer(out_dir: str, family: str, modules: dict, extra: dict, world: int, **overrides) -> OmniTrainer:
    extra_rows = extra
    extra = {k: v for k, v in extra.items() if k not in ROW_KEYS}
    mapping = extra.pop("mapping", None) or MODULES[family]
    per_device = extra.pop("global_batch", 8) // world
    if extra.pop("offline", False):
        extra.update(offline_modules=["vision"], offline_cache_dir=os.path.join(out_dir, "cache"))
    if extra.pop("empty_init", False):
        cls, folder = type(BUILDERS[family]()), released_folder(out_dir, family)
        model = OmniModel.from_model(cls, folder, modules=mapping, empty_init=True)
    else:
        model = OmniModel.from_model(BUILDERS_ALL[family](), modules=mapping)
    rows = case_rows(family, model.released, extra_rows)
    args = make_args(out_dir, modules=modules, per_device_train_batch_size=per_device, max_grad_norm=1.0,
                     **extra, **overrides)
    return OmniTrainer(model=model, args=args, train_dataset=rows, data_collator=COLLATE.get(family, collate))


def run(out_dir: str, name: str, family: str, modules: dict, extra: dict, world: int, resume: bool = False) -> dict:
    """One case; `world` ranks share each global batch (of 8 rows unless `extra` says). `resume`: saved at step 2,
    and a second run (another seed) resumed from there: the tensors that differ from the uninterrupted run's."""
    saving = dict(save_strategy="steps", save_steps=2) if resume else {}
    trainer = case_trainer(os.path.join(out_dir, name), family, modules, extra, world, **saving)
    read_before = READ["bytes"]
    trainer.train()
    model = trainer.model
    logged = trainer.state.log_history
    result = {"read": READ["bytes"] - read_before, "losses": [e["loss"] for e in logged if "loss" in e],
              "kinds": {n: s.kind for n, s in model.slots.items()}, "state": full_state(model),
              "parts": [[e[f"loss/{m}"] for m in PARTS[family]] for e in logged if "loss" in e and family in PARTS]}
    if resume:
        again = case_trainer(os.path.join(out_dir, name, "resumed"), family, modules, extra, world, seed=7)
        again.train(resume_from_checkpoint=os.path.join(out_dir, name, "checkpoint-2"))
        resumed = full_state(again.model)
        result["mismatch"] = [k for k in resumed if not torch.equal(resumed[k], result["state"][k])]
    before_export = READ["bytes"]
    trainer.save_model(os.path.join(out_dir, name, "export"))
    result["export_read"] = READ["bytes"] - before_export  # an offline module is read back by the main process only
    model.eval()
    with torch.no_grad():
        batch = trainer.data_collator([trainer.train_dataset[i] for i in range(4)])
        result["logits"] = tokens_only(model(**batch).logits, batch)
    return result


def tokens_only(logits: torch.Tensor, batch: dict) -> torch.Tensor:
    """The logits at the tokens, zero at the collator's (left) padding: a padding position's output is no token's
    (sequence parallelism computes it after the tokens, one process under a mask that hides every key)."""
    return logits * batch["attention_mask"][..., None]


def lacking(out_dir: str) -> str | None:
    """Rows 0-3 with images, 4-7 without: at 2 ranks, rank 0's first batch has images and rank 1's none."""
    model = OmniModel.from_model(BUILDERS["llava"](), modules=MODULES["llava"])
    rows = Rows("llava", model.released, 8)
    for i in range(4, 8):
        rows.rows[i] = {k: v[4:] for k, v in rows.rows[i].items() if k in ("input_ids", "labels")}
    modules = {"vision": {"trainable": False, "parallel": "fsdp"}, "projector": {"parallel": "ddp"},
               "llm": {"trainable": False}}
    trainer = OmniTrainer(model=model, args=make_args(os.path.join(out_dir, "lacking"), modules=modules,
                                                      per_device_train_batch_size=4, max_steps=1),
                          train_dataset=rows, data_collator=collate)
    try:
        trainer.train()
    except ValueError as err:
        return str(err)
    return None


def main(out_dir: str):
    global READ
    READ = count_reads()
    results = {}
    for name, (family, modules, extra) in CASES.items():
        if os.environ.get("MP_ADOPTED_ONLY") and name not in os.environ["MP_ADOPTED_ONLY"].split(","):
            continue
        mine = run(out_dir, name, family, modules, extra, int(os.environ["WORLD_SIZE"]), resume=True)
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, {k: v for k, v in mine.items() if k != "state"} | {
            "state": mine["state"] if dist.get_rank() == 0 else None})
        results[name] = everyone
    errors = [None] * dist.get_world_size()
    dist.all_gather_object(errors, lacking(out_dir))
    results["lacking"] = errors
    if dist.get_rank() == 0:
        torch.save(results, os.path.join(out_dir, "results.pt"))
    dist.barrier()


if __name__ == "__main__":
    main(sys.argv[1])
    end_distributed()
