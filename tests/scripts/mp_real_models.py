"""Real modules at 2 gloo ranks (`accelerate launch --multi_gpu --num_processes 2`), one launch for all:
DDP with a trainable ViT whose pooler the forward never uses and a ResNet whose BatchNorm buffers rank 0
broadcasts; FSDP for Mixtral and ViT beside DDP modules. Each: uninterrupted vs resumed (bitwise, on every rank),
then `evaluate()` and an export for the one-process comparison. Usage: mp_real_models.py OUT_DIR"""

import os
import sys

import torch
import torch.distributed as dist
from real_model_runs import mismatches, straight_and_resumed
from real_models import Batches
from launching import end_distributed

CASES = {
    "ddp": ("llama_fp32", dict(vit="full", resnet="full", bert="lora", clip="frozen", siglip="frozen",
                               projector="full", llm="full"), {}),
    "fsdp": ("mixtral_fp32", dict(vit="full", resnet="full", bert="frozen", clip="dora", siglip="frozen",
                                  projector="full", llm="full"),
             {"vit": {"parallel": "fsdp"}, "llm": {"parallel": "fsdp"}, "bert": {"parallel": "fsdp"}}),
}


def token_accuracy(prediction) -> dict:
    """compute_metrics: argmax accuracy of the caption tokens (the prefix and the last position excluded)."""
    logits, labels = prediction.predictions, prediction.label_ids
    guesses = logits[:, -labels.shape[1]:-1].argmax(-1)
    return {"accuracy": float((guesses == labels[:, 1:]).mean())}


def main(out_dir: str):
    from real_models import mode_overlay

    results = {}
    for name, (case, modes, extra) in CASES.items():
        modules = {n: {**mode_overlay(n, m), **extra.get(n, {})} for n, m in modes.items()}
        straight, final, resumed = straight_and_resumed(os.path.join(out_dir, name), case, modes=modes,
                                                        modules=modules, per_device_train_batch_size=2)
        plugin = straight.plugin
        ddp_flags = {}
        for module_name, kind in plugin.wrapped.items():
            if kind == "ddp":
                from torch.distributed._composable.replicate import replicate

                ddp_flags[module_name] = replicate.state(getattr(straight.model, module_name))._ddp.find_unused_parameters
        straight.compute_metrics = token_accuracy
        metrics = straight.evaluate(eval_dataset=Batches(16, seed=1))
        predictions = straight.predict(Batches(16, seed=1)).predictions
        straight.save_model(os.path.join(out_dir, name, "export"))
        mine = {"mismatch": mismatches(final, resumed), "wrapped": dict(plugin.wrapped), "ddp_find_unused": ddp_flags,
                "eval_loss": metrics["eval_loss"], "eval_accuracy": metrics["eval_accuracy"],
                "predictions": torch.as_tensor(predictions)}
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
        results[name] = everyone
    if dist.get_rank() == 0:
        torch.save(results, os.path.join(out_dir, "results.pt"))
    dist.barrier()


if __name__ == "__main__":
    main(sys.argv[1])
    end_distributed()
