"""What each per-module layout costs per rank per step, in theory, at 8, 64 and 512 GPUs (8 per node): bytes sent
within a node and across nodes, and bytes held. Pure arithmetic from the formulas below (nothing runs);
`bench/mesh.py` measures the same formulas at 4 gloo ranks. `docs/parallel.md` quotes this table.

    python bench/layout_costs.py

Per rank and optimizer step, ring model ((n-1)/n of a collective's bytes over a group of n), bf16 compute with fp32
masters (FSDP2 gathers parameters in bf16: 2 B, reduces gradients in fp32: 4 B; AdamW holds 16 B per parameter:
fp32 master, fp32 gradient, two fp32 moments), no activation checkpointing, b tokens per rank:
- FSDP2 over n ranks on p parameters: all-gather forward + backward 2 x 2p, reduce-scatter 4p, times (n-1)/n. HSDP
  R x S: that over S, plus the all-reduce of the 4p / S gradient shard over R: 2 x 4p / S x (R-1)/R.
- Tensor parallel T (its FSDP2 over S = world / T on p / T), transformers' styles as `bench/mesh.py` counts them:
  per layer 2 all-reduces forward (the row-wise o_proj and down_proj outputs) and 5 backward (the input gradient of
  each column-wise q, k, v, gate, up: they are not fused), plus the vocabulary-split embeddings' output forward and
  the LM head's input gradient backward, each 2 x (T-1)/T of the group's activations T x b x h x 2 B; the LM head's
  logits all-gathered over the vocabulary ((T-1)/T x T x b x V x 2 B); the row boundary all-gathers the input
  embeddings (b x h x 2 B from each of T-1 ranks) and, in backward, the logits' gradient rows (b x V x 2 B from each
  of T-1 ranks).
- Expert parallel E (experts FSDP2 over efsdp = world / E on p_experts / E; the dense rest over the world): per MoE
  layer two all-to-alls forward (dispatch, combine) and two backward, each (E-1)/E of b x k x h x 2 B (k: experts
  per token, uniform routing).
A group lies within a node when its ranks do: tp and ep groups of at most 8 consecutive ranks, HSDP's shard groups of
8; everything else crosses nodes (at 8 GPUs, nothing does).
"""

from __future__ import annotations

GB = 1e9
NODE = 8
TOKENS = 4096  # per rank per step

DENSE = dict(name="Llama-3 70B", params=70.6e9, hidden=8192, layers=80, vocab=128256)
MOE = dict(name="Mixtral 8x7B", params=46.7e9, experts_params=45.1e9, hidden=4096, layers=32, vocab=32000,
           experts=8, k=2)


def ring(n: int) -> float:
    return (n - 1) / n if n > 1 else 0.0


def fsdp(params: float, n: int) -> float:
    return (2 * 2 * params + 4 * params) * ring(n)


def place(world: int, group: int, consecutive: bool) -> str:
    """'within' when every group of this size lies in one node."""
    return "within" if world <= NODE or (consecutive and group <= NODE) else "cross"


def layouts(world: int):
    """(module, layout, within GB, cross GB, held GB per rank) for each layout that applies at this world size."""
    p, h, L, V, b = DENSE["params"], DENSE["hidden"], DENSE["layers"], DENSE["vocab"], TOKENS
    rows = []
    full = fsdp(p, world)
    rows.append((DENSE["name"], f"full shard ({world},)", *split(full, place(world, world, True)), 16 * p / world))
    if world > NODE:
        r = world // NODE
        within, cross = fsdp(p, NODE), 2 * 4 * p / NODE * ring(r)
        rows.append((DENSE["name"], f"HSDP {r} x {NODE}", within, cross, 16 * p / NODE))
    T = min(NODE, world)
    s = world // T
    acts = (L * 7 + 2) * 2 * ring(T) * T * b * h * 2 + ring(T) * T * b * V * 2 + (T - 1) * b * (h + V) * 2
    shard = fsdp(p / T, s)
    within = acts + (shard if place(world, s, False) == "within" else 0)
    cross = shard if place(world, s, False) == "cross" else 0
    rows.append((DENSE["name"], f"dp_shard {s} x tp {T}", within, cross, 16 * p / world))

    pe, pd, E, k, hm, Lm = MOE["experts_params"], MOE["params"] - MOE["experts_params"], MOE["experts"], MOE["k"], \
        MOE["hidden"], MOE["layers"]
    whole = fsdp(pe + pd, world)
    rows.append((MOE["name"], f"full shard ({world},)", *split(whole, place(world, world, True)),
                 16 * (pe + pd) / world))
    E = min(E, world)
    efsdp = world // E
    dispatch = Lm * 4 * ring(E) * b * k * hm * 2
    experts, dense = fsdp(pe / E, efsdp), fsdp(pd, world)
    where = place(world, efsdp, False)
    within = dispatch + (experts if where == "within" else 0) + (dense if world <= NODE else 0)
    cross = (experts if where == "cross" else 0) + (dense if world > NODE else 0)
    rows.append((MOE["name"], f"dp_shard {world} x ep {E}", within, cross, 16 * (pe / E / efsdp + pd / world)))
    return rows


def split(value: float, where: str) -> tuple[float, float]:
    return (value, 0.0) if where == "within" else (0.0, value)


def main():
    print(f"Per rank per step, {TOKENS} tokens per rank, bf16 gathers, fp32 reductions and masters, {NODE} GPUs a "
          "node (bench/layout_costs.py)\n")
    print("| GPUs | module | layout | sent within a node (GB) | sent across nodes (GB) | params + grads + AdamW held "
          "(GB) |")
    print("|---|---|---|---|---|---|")
    for world in (8, 64, 512):
        for module, layout, within, cross, held in layouts(world):
            print(f"| {world} | {module} | {layout} | {within / GB:.1f} | {cross / GB:.1f} | {held / GB:.1f} |")


if __name__ == "__main__":
    main()
