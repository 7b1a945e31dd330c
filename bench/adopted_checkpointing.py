"""What `modules.llm.activation_checkpointing: true` saves on an adopted LLaVA (`OmniModel.from_model`): the bytes
held for backward at the end of the forward, and the peak RSS rise of one training step, with and without it, the
LLM trained with LoRA and in full. One process, CPU, each variant in a fresh process.

    python bench/adopted_checkpointing.py      # four launches, 4-5 minutes on 2 CPU cores

The model: a LLaVA with a CLIP tower (64 wide, 2 layers, 64 image tokens) and a Llama of 8 layers, 512 wide
(~27M parameters); batch 8 x 320 tokens (64 image + 256 text). Vision frozen, projector trained.
Measured on the second step (the first allocates the optimizer state):
- held for backward: the distinct storages autograd saves (a `saved_tensors_hooks` pack hook; parameters
  excluded), plus the inputs each checkpointed layer keeps for its recompute (its call's tensors);
- peak RSS rise: VmHWM after `echo 5 > /proc/self/clear_refs` before the step, minus VmRSS there, under
  MALLOC_MMAP_THRESHOLD_=131072 (glibc otherwise keeps freed memory).
Goal: held with checkpointing <= 0.3 of held without; losses equal (checkpointing recomputes, it changes nothing).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

from scale import MB, proc_status

BATCH, TEXT = 8, 256
VARIANTS = [(llm, checked) for llm in ("LoRA", "full") for checked in (False, True)]


def llava():
    import torch
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration

    vision = CLIPVisionConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                              image_size=32, patch_size=4, projection_dim=64)
    text = LlamaConfig(vocab_size=1024, hidden_size=512, intermediate_size=1536, num_hidden_layers=8,
                       num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=512)
    config = LlavaConfig(vision_config=vision, text_config=text, image_token_index=1023, vision_feature_layer=-1,
                         vision_feature_select_strategy="default", image_seq_length=64)
    torch.manual_seed(0)
    return LlavaForConditionalGeneration(config)


def batch(step: int) -> dict:
    import torch

    g = torch.Generator().manual_seed(step)
    text = torch.randint(2, 1000, (BATCH, TEXT), generator=g)
    ids = torch.cat([torch.full((BATCH, 64), 1023), text], dim=1)
    labels = torch.cat([torch.full((BATCH, 64), -100), text], dim=1)
    return {"input_ids": ids, "labels": labels, "attention_mask": torch.ones_like(ids),
            "pixel_values": torch.randn(BATCH, 3, 32, 32, generator=g)}


def held_for_backward(model, run) -> tuple[int, object]:
    """Bytes of the distinct storages autograd holds for backward when `run()` returns (parameters excluded)."""
    import torch
    from torch.utils._pytree import tree_leaves
    from transformers.modeling_layers import GradientCheckpointingLayer

    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    held = {}

    def keep(tensor):
        if isinstance(tensor, torch.Tensor) and tensor.untyped_storage().data_ptr() not in params:
            held[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()

    def pack(tensor):
        keep(tensor)
        return tensor

    layers = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer) and m.gradient_checkpointing]
    def inputs(_, args, kwargs):
        for t in tree_leaves((args, kwargs)):
            keep(t)

    hooks = [m.register_forward_pre_hook(inputs, with_kwargs=True) for m in layers]
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        out = run()
    for hook in hooks:
        hook.remove()
    return sum(held.values()), out


def worker(llm: str, checked: bool) -> None:
    import gc

    from accelerate import Accelerator

    from hf_omni import OmniModel, OmniPlugin

    entry = {"learning_rate": 1e-4, "activation_checkpointing": checked}
    if llm == "LoRA":
        entry["lora"] = {"r": 16, "lora_alpha": 32, "target_modules": ["q_proj", "v_proj"]}
    model = OmniModel.from_model(llava(), modules={"vision": "model.vision_tower",
                                                   "projector": "model.multi_modal_projector",
                                                   "llm": ["model.language_model", "lm_head"]})
    plugin = OmniPlugin(modules={"vision": {"trainable": False}, "llm": entry}, defaults={"learning_rate": 1e-3})
    model, optimizer, _ = plugin.prepare(Accelerator(cpu=True), model, num_training_steps=2)
    losses = []
    for step in (1, 2):
        gc.collect()
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        rss0, t0 = proc_status("VmRSS")["VmRSS"], time.perf_counter()
        held, out = held_for_backward(model, lambda: model(**batch(step)))
        out.loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        seconds, rise = time.perf_counter() - t0, proc_status("VmHWM")["VmHWM"] - rss0
        losses.append(out.loss.item())
        del out
    print("RESULT " + json.dumps({"held": held, "rise": rise, "seconds": seconds, "losses": losses}))


def run(llm: str, checked: bool) -> dict:
    cmd = [sys.executable, __file__, "--worker", llm] + (["--checked"] if checked else [])
    result = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072"})
    if result.returncode:
        sys.stderr.write(result.stdout[-3000:] + result.stderr[-6000:])
        raise SystemExit(f"bench/adopted_checkpointing.py: {llm} {checked} failed")
    return json.loads(next(line for line in result.stdout.splitlines() if line.startswith("RESULT "))[7:])


def main() -> None:
    results = {variant: run(*variant) for variant in VARIANTS}
    print("\nbench/adopted_checkpointing.py: adopted LLaVA, Llama 8 x 512, batch 8 x 320 tokens; step 2\n")
    print("| llm | activation_checkpointing | held for backward | / without | peak RSS rise | step | losses equal |")
    print("|---|---|---|---|---|---|---|")
    for (llm, checked), r in results.items():
        base = results[(llm, False)]
        print(f"| {llm} | {str(checked).lower()} | {r['held'] / MB:.0f} MiB | {r['held'] / base['held']:.3f} | "
              f"{r['rise'] / MB:.0f} MiB | {r['seconds']:.2f} s | "
              f"{max(abs(a - b) for a, b in zip(r['losses'], base['losses'])):.1e} |")


if __name__ == "__main__":
    if "--worker" in sys.argv:
        worker(sys.argv[sys.argv.index("--worker") + 1], "--checked" in sys.argv)
    else:
        main()
