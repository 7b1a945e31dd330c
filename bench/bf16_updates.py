"""What pure-bf16 training loses: the share of a bf16 LLM's elements that 3 AdamW steps at a small learning rate
change, with bf16 parameters and moments (`master_dtype: bfloat16`) against fp32 masters (`auto`).

    python bench/bf16_updates.py [--seeds 0 1 2]      # one process, CPU, a few seconds a seed

Per seed: the demo model (hf_omni.testing.digits, LLM hidden 64 x 2 layers) built with that seed, its LLM saved in
bf16 (a released LLM's files) and loaded as saved, then trained by OmniTrainer under `bf16: true` for 3 steps of
batch 8 at a learning rate of 1e-6 (vision frozen), once per `master_dtype`. Printed: the share of the first
layer's `q_proj` elements and of all the LLM's trained elements whose value differs from the loaded one. A bf16
parameter keeps an update only where it is larger than half its spacing (2^-8 of its magnitude); an fp32 master
keeps every one (and rounds to bf16 once, at export).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile

LR, STEPS, BATCH = 1e-6, 3, 8


def moved_shares(folder: str, master_dtype: str, seed: int, out: str) -> tuple[int, int, float]:
    """(layer 0's q_proj elements changed, its elements, share of the LLM's trainable elements changed)."""
    import torch

    from hf_omni import OmniTrainer, OmniTrainingArguments
    from hf_omni.testing.digits import Captioner, load_splits

    model = Captioner.from_pretrained(folder)
    assert model.llm.model.layers[0].self_attn.q_proj.weight.dtype == torch.bfloat16
    names = [n for n, p in model.llm.named_parameters() if p.requires_grad]
    before = {n: p.detach().float().clone() for n, p in model.llm.named_parameters()}
    train, _ = load_splits(model.processors["llm"])
    args = OmniTrainingArguments(
        output_dir=out, use_cpu=True, report_to="none", save_strategy="no", disable_tqdm=True, logging_steps=10_000,
        optim="adamw_torch", seed=seed, dataloader_drop_last=True, per_device_train_batch_size=BATCH,
        max_steps=STEPS, learning_rate=LR, bf16=True,
        modules={"vision": {"trainable": False}, "llm": {"master_dtype": master_dtype}})
    OmniTrainer(model=model, args=args, train_dataset=torch.utils.data.Subset(train, range(STEPS * BATCH))).train()
    after = dict(model.llm.named_parameters())
    changed = {n: (after[n].detach().float() != before[n]) for n in names}
    q_proj = changed["model.layers.0.self_attn.q_proj.weight"]
    total = sum(c.sum().item() for c in changed.values()) / sum(c.numel() for c in changed.values())
    return int(q_proj.sum()), q_proj.numel(), total


def main() -> None:
    import torch

    from hf_omni.testing.digits import build_model

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    seeds = parser.parse_args().seeds
    rows = {"bfloat16": [], "auto": []}
    with tempfile.TemporaryDirectory() as tmp:
        for seed in seeds:
            model = build_model(seed=seed)
            model.llm.to(torch.bfloat16)
            folder = f"{tmp}/seed{seed}"
            model.save_pretrained(folder)
            for master_dtype in rows:
                rows[master_dtype].append(moved_shares(folder, master_dtype, seed, f"{tmp}/out_{master_dtype}"))
    print(f"bench/bf16_updates.py: the demo LLM saved in bf16, `bf16: true`, {STEPS} AdamW steps of batch {BATCH} at "
          f"lr {LR:g}, seeds {' '.join(map(str, seeds))}\n")
    print("| master_dtype | seed | q_proj (layer 0) elements changed | LLM elements changed |\n|---|---|---|---|")
    for master_dtype, shares in rows.items():
        for seed, (moved, n, total) in zip(seeds, shares):
            print(f"| {master_dtype} | {seed} | {moved} / {n} ({moved / n:.2%}) | {total:.3%} |")
    for master_dtype, shares in rows.items():
        qs, totals = [moved / n for moved, n, _ in shares], [t for _, _, t in shares]
        print(f"\n{master_dtype}: q_proj {min(qs):.2%}-{max(qs):.2%} (median {statistics.median(qs):.2%}), "
              f"LLM {min(totals):.2%}-{max(totals):.2%} (median {statistics.median(totals):.2%})", end="")
    print()


if __name__ == "__main__":
    main()
