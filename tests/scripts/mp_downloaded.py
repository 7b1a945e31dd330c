"""The downloaded-models cases at 2 gloo ranks (`accelerate launch --multi_gpu --num_processes 2`), one launch:
a tied-embedding Gemma and a T5 encoder (its `shared` tied) sharded with FSDP from an empty_init build (trained,
resumed bitwise, exported), the plugin's composites under `accelerator.prepare` + `accumulate()`, `parallel:
none` refused on a trainable module, and one step with and without `average_tokens_across_devices` on uneven token
counts. Usage: mp_downloaded.py OUT_DIR"""

import os
import sys

import helpers
import torch
from custom_loops import AVERAGE_TOKENS, UnevenTokens, accumulate_loop
from real_model_runs import mismatches, straight_and_resumed
from real_models import Batches, mode_overlay

from hf_omni import OmniTrainer
from launching import end_distributed

TIED = dict(t5="full", whisper="frozen", qwen2vl="full", projector="full", llm="full")
FSDP = {"t5": {"parallel": "fsdp"}, "llm": {"parallel": "fsdp"}}


def tied_fsdp(out_dir: str) -> dict:
    modules = {n: {**mode_overlay(n, m), **FSDP.get(n, {})} for n, m in TIED.items()}
    straight, final, resumed = straight_and_resumed(out_dir, "tied_fp32_empty_init", modes=TIED, modules=modules,
                                                    per_device_train_batch_size=2)
    model = straight.model
    llm, t5 = model.llm, model.t5
    batch = {k: torch.stack([Batches()[i][k] for i in range(4)]) for k in ("pixel_values", "text_ids", "input_ids")}
    model.eval()
    with torch.no_grad():
        logits = model(**batch).logits
    straight.save_model(os.path.join(out_dir, "export"))
    return {"mismatch": mismatches(final, resumed), "wrapped": dict(straight.plugin.wrapped),
            "llm_tied": llm.lm_head.weight is llm.model.embed_tokens.weight,
            "llm_sharded": hasattr(llm.lm_head.weight, "to_local"),
            "t5_tied": t5.shared.weight is t5.encoder.embed_tokens.weight,
            "t5_sharded": hasattr(t5.shared.weight, "to_local"), "logits": logits}


def parallel_none(out_dir: str) -> str:
    model = helpers.tiny_model()
    args = helpers.make_args(out_dir, modules={"llm": {"parallel": "none"}})
    try:
        make = OmniTrainer(model=model, args=args, train_dataset=helpers.tiny_data(model, 8))
    except ValueError as err:
        return str(err)
    return f"accepted: {make.plugin.module_args['llm'].parallel}"


def average_tokens(out_dir: str, across: bool) -> dict:
    """One SGD step on uneven token counts per rank, with or without Trainer's average_tokens_across_devices."""
    model = helpers.tiny_model()
    args = helpers.make_args(out_dir, average_tokens_across_devices=across, **AVERAGE_TOKENS)
    OmniTrainer(model=model, args=args, train_dataset=UnevenTokens(model)).train()
    return {k: v.detach().clone() for k, v in model.state_dict().items() if not k.startswith("vision.")}


def main(out_dir: str):
    results = {"parallel_none": parallel_none(os.path.join(out_dir, "none"))}
    composite, composite_lrs = accumulate_loop(True, os.path.join(out_dir, "composite"))
    plain, plain_lrs = accumulate_loop(False, os.path.join(out_dir, "plain"))
    results["accumulate"] = {"lrs_equal": composite_lrs == plain_lrs,
                             "mismatch": [k for k in plain if not torch.equal(composite[k], plain[k])]}
    results["tied"] = tied_fsdp(os.path.join(out_dir, "tied"))
    results["average_tokens"] = {across: average_tokens(os.path.join(out_dir, f"tokens_{across}"), across)
                                 for across in (True, False)}
    helpers.save_every_rank(results, os.path.join(out_dir, "results.pt"))


if __name__ == "__main__":
    main(sys.argv[1])
    end_distributed()
