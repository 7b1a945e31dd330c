"""Runs shared by the real-model matrix (one process) and its 2-rank part: train 4 steps with a checkpoint at
step 2, then resume that checkpoint in a fresh model built with other initial weights."""

from __future__ import annotations

import os

import torch
from helpers import full_state, make_args
from real_models import Batches, MultiEncoder, build, mode_overlay

from hf_omni import OmniTrainer

# name -> (llm, dtype of the saved module folders or None for modules built in memory, empty_init, modes)
MATRIX = {
    "llama_fp32": ("llama", None, False,
                   dict(vit="full", resnet="full", bert="lora", clip="dora", siglip="frozen", projector="full",
                        llm="lora_emb")),
    "mixtral_fp32": ("mixtral", None, False,
                     dict(vit="dora", resnet="lora", bert="frozen", clip="lora_emb", siglip="to_save",
                          projector="full", llm="full")),
    "llama_bf16": ("llama", torch.bfloat16, False,
                   dict(vit="rslora", resnet="frozen", bert="to_save", clip="full", siglip="lora_emb",
                        projector="full", llm="dora")),
    "mixtral_bf16_empty_init": ("mixtral", torch.bfloat16, True,
                                dict(vit="full", resnet="full", bert="lora", clip="dora", siglip="frozen",
                                     projector="full", llm="full")),
    "llama_fp32_empty_init": ("llama", torch.float32, True,
                              dict(vit="frozen", resnet="full", bert="full", clip="lora", siglip="dora",
                                   projector="full", llm="lora")),
    # bf16 files loaded in fp32 (`from_pretrained(..., dtype=torch.float32)`): frozen ones re-read from them
    "bf16_files_in_fp32": ("llama", torch.bfloat16, False,
                           dict(vit="frozen", resnet="frozen", bert="lora", clip="frozen", siglip="full",
                                projector="full", llm="full")),
    # tied embeddings (Gemma; Llama with tie_word_embeddings; T5's shared), classes deep inside transformers
    "tied_fp32": ("gemma", None, False,
                  dict(t5="lora_emb", whisper="full", qwen2vl="dora", projector="full", llm="lora_emb")),
    "tied_fp32_empty_init": ("gemma", torch.float32, True,
                             dict(t5="full", whisper="frozen", qwen2vl="full", projector="full", llm="full")),
    "tied_bf16_empty_init": ("llama_tied", torch.bfloat16, True,
                             dict(t5="to_save", whisper="lora", qwen2vl="frozen", projector="full", llm="dora")),
}
LOAD_DTYPE = {"bf16_files_in_fp32": torch.float32}


def encoders_of(case: str) -> list[str]:
    return [n for n in MATRIX[case][3] if n not in ("projector", "llm")]


def saved_folder(root: str, llm: str, dtype: torch.dtype, encoders: list[str]) -> str:
    """The initial model written once as module folders in `dtype` (released weights, as users bring them); every
    rank calls it."""
    import torch.distributed as dist

    folder = os.path.join(root, f"saved_{'_'.join(encoders)}_{llm}_{str(dtype).split('.')[-1]}")
    distributed = dist.is_available() and dist.is_initialized()
    if not os.path.isdir(folder) and (not distributed or dist.get_rank() == 0):  # written once, by rank 0
        model = build(encoders, llm=llm)
        for module in model.omni_modules().values():
            module.to(dtype)
        model.save_pretrained(folder)
    if distributed:
        dist.barrier()
    return folder


def make_model(root: str, case: str, seed: int = 0):
    llm, dtype, empty_init, _ = MATRIX[case]
    if dtype is None:
        model = build(encoders_of(case), llm=llm, seed=seed)
        if "siglip" in model.module_names:
            model.siglip.to(torch.bfloat16)  # a frozen (or trained) encoder in another dtype than the rest
        return model
    extra = {"dtype": LOAD_DTYPE[case]} if case in LOAD_DTYPE else {}
    model = MultiEncoder.from_pretrained(saved_folder(root, llm, dtype, encoders_of(case)), empty_init=empty_init,
                                         **extra)
    assert all(p.dtype == LOAD_DTYPE.get(case, dtype) for p in model.parameters() if p.is_floating_point())
    if seed:  # other initial weights for the resumed run (empty_init modules are filled from the checkpoint)
        torch.manual_seed(seed)
        for module in model.omni_modules().values():
            for p in module.parameters():
                if not p.is_meta:
                    p.data.normal_(0, 0.02)
    return model


def case_trainer(root: str, case: str, out: str, seed: int = 0, modes: dict | None = None, **overrides):
    modes = modes or MATRIX[case][3]
    args = dict(max_steps=4, save_strategy="steps", save_steps=2, per_device_train_batch_size=4,
                modules={n: mode_overlay(n, m) for n, m in modes.items()}, train_sampling_strategy="random")
    args.update(overrides)
    return OmniTrainer(model=make_model(root, case, seed), args=make_args(out, **args), train_dataset=Batches())


def straight_and_resumed(root: str, case: str, **overrides):
    """(trainer of the uninterrupted run, its final state, the resumed run's final state)."""
    straight = case_trainer(root, case, os.path.join(root, case, "straight"), **overrides)
    straight.train()
    resumed = case_trainer(root, case, os.path.join(root, case, "resumed"), seed=7, **overrides)
    resumed.train(resume_from_checkpoint=os.path.join(root, case, "straight", "checkpoint-2"))
    return straight, full_state(straight.model), full_state(resumed.model)


def mismatches(a: dict, b: dict) -> list[str]:
    assert a.keys() == b.keys()
    return [k for k in a if not torch.equal(a[k], b[k])]
