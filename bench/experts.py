"""Fused MoE experts at large world sizes: what FSDP2 pads and gathers for one Mixtral-8x7B decoder layer, with
every parameter on dim 0 (FSDP2's default) and with hf_omni's placement rule (`hf_omni/parallel/placement.py`).

    python bench/experts.py               # in one process, a second or two

No ranks are launched: torch's fake process group lets this process shard the layer on the meta device as one rank
of W would (`hf_omni.testing.shard_padding`), and FSDP2's own padded shard of each parameter is read back. Per
world size and rule: the bytes one all-gather of every parameter outputs on a rank over the layer's bytes (each
forward and backward moves that), the worst such ratio of one parameter, the padded bytes a rank keeps of the
parameters it holds no data of, and the experts' dims. Goals at W = 512: gathered / real <= 1.05; padded bytes on
data-free ranks 0.
"""

from __future__ import annotations

from hf_omni.parallel.placement import placement_fn
from hf_omni.testing.shard_padding import dim0_placement, mixtral_layer, padding_figures

WORLDS = (8, 64, 512)
RULES = {"dim 0": dim0_placement, "hf_omni rule": placement_fn}
GIB = 2**30


def main() -> None:
    print("| world | placement | gathered / real (layer) | worst tensor | padded bytes a data-free rank keeps "
          "| experts' dim |")
    print("|---|---|---|---|---|---|")
    for world in WORLDS:
        for rule, fn in RULES.items():
            f = padding_figures(mixtral_layer, world, fn)
            experts = sorted({t["dim"] for n, t in f["tensors"].items() if ".experts." in n})
            print(f"| {world} | {rule} | {f['ratio']:.3f} | {f['worst']:.1f} | {f['idle_padding'] / GIB:.3f} GiB "
                  f"| {', '.join(map(str, experts))} |")
    f = padding_figures(mixtral_layer, 512, dim0_placement)["tensors"]["mlp.experts.gate_up_proj"]
    print(f"\nlayer: {padding_figures(mixtral_layer, 8, placement_fn)['bytes'] / GIB:.2f} GiB in fp32; "
          f"gate_up_proj {f['shape']} at 512 ranks on dim 0: {f['idle'] / GIB:.3f} GiB padded shard per data-free "
          f"rank, {f['ratio'] * f['bytes'] / GIB:.0f} GiB out of each all-gather ({f['ratio']:.0f}x)")


if __name__ == "__main__":
    main()
