"""Run under `accelerate launch --multi_gpu --num_processes 2` (gloo, use_cpu): the tiny diffusion pipelines
(tests/diffusion_runs.py) trained at 2 ranks (batch 2 each): SD with its UNet sharded and its text encoder
replicated (trained, checkpointed, resumed, exported), Flux with its transformer sharded (trained, exported), and
Flux with LoRA on the sharded transformer and the replicated CLIP encoder (resumed; exported: merged components and
diffusers' LoRA file, the adapters gathered from both ranks), and Wan with its video transformer sequence-parallel
over both ranks (diffusers' context parallelism; trained, resumed, exported, sampled).

Usage: mp_diffusion.py OUT_DIR. Rank 0 writes OUT_DIR/<scenario>.pt; tests/test_diffusion.py compares them with
the hand-written loop at 1 process and loads the exports with diffusers alone.
"""

import copy
import os
import sys

import torch
import torch.distributed as dist
from diffusion_runs import FLUX, FLUX_LORA, SD, WAN_SP, run

from helpers import save_every_rank
from launching import end_distributed

SCENARIOS = {"sd": ("sd", SD, True), "flux": ("flux", FLUX, False), "flux_lora": ("flux", FLUX_LORA, True),
             "wan_sp2": ("wan", WAN_SP, True)}
ONLY = os.environ.get("MP_DIFFUSION_ONLY")


def wan_ragged(out_dir: str):
    """Wan's transformer at sp 2 (FSDP2 over dp_shard 1 x sp 2), the boundary alone: rank r runs r + 1 rows of its
    own, its latents and text states requiring gradients. Reference: the same transformer in this process on every
    rank's rows, objective the sum of the ranks' losses. Then a token count 2 does not divide (3 latent frames of 2 x
    2 latents: 3 tokens) on every rank: each raises the same refusal."""
    from accelerate import PartialState
    from tiny_pipelines import wan_pipeline
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from hf_omni.compat import flatten_mesh
    from hf_omni.core.errors import OmniArgumentError
    from hf_omni.parallel.sequence import SequenceLayout

    PartialState()  # the process group (OmniTrainer makes it in the scenarios above)
    model = wan_pipeline().transformer
    reference = copy.deepcopy(model)
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (1, world), mesh_dim_names=("dp_shard", "sp"))
    layout = SequenceLayout("transformer", {"dp_shard_size": 1, "sp_size": world})
    layout.check(model)
    layout.apply(model, mesh)
    fully_shard(model, mesh=mesh[flatten_mesh(mesh, ("dp_shard", "sp"))])
    layout.after_fsdp(model, mesh, ())
    seen = []  # what the second block runs on: this rank's tokens of the group's rows (the first splits on entry)
    model.blocks[1].register_forward_pre_hook(lambda m, args: seen.append(tuple(args[0].shape)))
    g = torch.Generator().manual_seed(1)
    rows = [(torch.randn(r + 1, 16, 3, 4, 4, generator=g), torch.rand(r + 1, generator=g) * 1000,
             torch.randn(r + 1, 16, 32, generator=g)) for r in range(world)]
    x, t, e = (v.clone().requires_grad_(v.dtype.is_floating_point and i != 1) for i, v in enumerate(rows[rank]))
    out = model(hidden_states=x, timestep=t, encoder_hidden_states=e, return_dict=False)[0]
    out.square().mean().backward()
    refs = [[v.clone().requires_grad_(i != 1) for i, v in enumerate(r)] for r in rows]
    ref_outs = [reference(hidden_states=a, timestep=b, encoder_hidden_states=c, return_dict=False)[0]
                for a, b, c in refs]
    sum(o.square().mean() for o in ref_outs).backward()
    ref = dict(reference.named_parameters())
    grads = {n: p.grad.full_tensor() * world for n, p in model.named_parameters()}  # FSDP2's average: x N = the sum
    diffs = {"output": (out - ref_outs[rank]).abs().max().item(), "shape": tuple(out.shape),
             "params": max((grads[n] - ref[n].grad).abs().max().item() for n in grads),
             "latents": (x.grad - refs[rank][0].grad).abs().max().item(),
             "text": (e.grad - refs[rank][2].grad).abs().max().item(),
             "grad_scale": max(p.grad.abs().max().item() for p in reference.parameters()), "tokens": seen[0]}
    try:  # 3 tokens on 2 ranks: refused on each (every rank holds the group's rows, so every rank raises)
        model(hidden_states=torch.randn(1, 16, 3, 2, 2), timestep=t[:1], encoder_hidden_states=e[:1].detach())
    except OmniArgumentError as err:
        diffs["refused"] = str(err)
    save_every_rank(diffs, os.path.join(out_dir, "wan_ragged.pt"))


def main(out_dir: str):
    for name, (kind, modules, resume) in SCENARIOS.items():
        if ONLY and name not in ONLY.split(","):
            continue
        result = run(kind, os.path.join(out_dir, name), modules, batch=2, resume=resume)
        if dist.get_rank() == 0:
            torch.save(result, os.path.join(out_dir, f"{name}.pt"))
        dist.barrier()
    if not ONLY or "wan_ragged" in ONLY.split(","):
        wan_ragged(out_dir)


if __name__ == "__main__":
    main(sys.argv[1])
    end_distributed()
