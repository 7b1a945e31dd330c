"""Run under `accelerate launch --multi_gpu --num_processes 4` (gloo, CPU): a tiny Llama (vocab 130, intermediate
120: uneven over every mesh dim) tensor-parallel by transformers' own plan on a (dp_shard 2, tp 2) mesh, then
FSDP2 per layer and root on dp_shard, as docs' design notes drive it. Checks on every rank, against the full
tensors and against the same model in this process without any parallelism:
- `shards.box.local_box` of every parameter ((_StridedShard(0), Shard(0)) column splits, (Shard(0), Shard(1)) row
  splits, norms on dp_shard alone) is where its local shard sits in `full_tensor()`, and `box_of` of the reference;
- after one backward (each dp_shard rank its own batch, shared by its tp group), hf_omni's per-module gradient norm
  (2, 1, inf) and its clipping (per module and global) equal the reference's.

Usage: mp_tp_boxes.py OUT_DIR. Each rank writes OUT_DIR/rank<r>.json: the placements it saw and every mismatch."""

import copy
import json
import os
import sys

import torch
import torch.distributed as dist
from launching import end_distributed
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.distributed import DistributedConfig
from transformers.distributed.tensor_parallel import apply_tensor_parallelism
from transformers.distributed.utils import TransformersDeviceMesh

from hf_omni.optim.gradients import clip_grad_norms, module_grad_norm
from hf_omni.optim.optimizers import ModuleOptimizers
from hf_omni.shards.box import box_of, local_box

ATOL = 1e-6


def build():
    torch.manual_seed(0)  # the same weights on every rank: TP and FSDP keep each rank's part of them
    config = LlamaConfig(vocab_size=130, hidden_size=64, intermediate_size=120, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    return LlamaForCausalLM(config)


def parallel(model, mesh):
    model._mesh_manager = TransformersDeviceMesh(mesh, mesh)  # no experts: the expert view is never asked for
    tp_plan = model._resolve_parallel_plans(DistributedConfig(tp_size=2, fsdp_size=2))[0]
    apply_tensor_parallelism(model, mesh["tp"], tp_plan)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh["dp_shard"])
    fully_shard(model, mesh=mesh["dp_shard"])
    return model


def batch(index: int) -> torch.Tensor:
    return torch.randint(0, 130, (3, 8), generator=torch.Generator().manual_seed(100 + index))


def close(name: str, mine, ref, problems: list) -> None:
    mine, ref = torch.as_tensor(mine).double(), torch.as_tensor(ref).double()
    if mine.shape != ref.shape or not torch.allclose(mine, ref, atol=ATOL, rtol=ATOL):
        err = (mine - ref).abs().max().item() if mine.shape == ref.shape else f"shapes {mine.shape} {ref.shape}"
        problems.append(f"{name}: differs by {err}")


def main(out_dir: str) -> None:
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_shard", "tp"))
    reference = build()
    model = parallel(copy.deepcopy(reference), mesh)
    refs = dict(reference.named_parameters())
    problems, placements = [], {}
    for name, param in model.named_parameters():  # every rank, in the same order (full_tensor gathers)
        placements[name] = [str(p) for p in param.placements] + [str(param.device_mesh.mesh_dim_names)]
        full, box, local = param.full_tensor(), local_box(param), param.to_local()
        if not torch.equal(full[box], local):
            problems.append(f"{name} {param.placements}: local_box {box} is not where its shard sits")
        if not torch.equal(box_of(refs[name].detach(), param), local):
            problems.append(f"{name}: box_of the reference differs from the shard")

    dp = mesh["dp_shard"].get_local_rank()
    model(input_ids=batch(dp), labels=batch(dp)).loss.mul(40).backward()  # large enough to be clipped
    sum(reference(input_ids=batch(i), labels=batch(i)).loss for i in range(2)).mul(20).backward()
    params, ref_params = list(model.parameters()), list(reference.parameters())
    ref_grads = [p.grad for p in ref_params]
    for norm_type in (2.0, 1.0, float("inf")):
        close(f"norm {norm_type}", module_grad_norm(params, torch.device("cpu"), norm_type),
              torch.nn.utils.get_total_norm(ref_grads, norm_type), problems)

    ref_norm = torch.nn.utils.get_total_norm(ref_grads)
    limit = float(ref_norm) / 3
    optimizer = ModuleOptimizers({"llm": torch.optim.SGD(params, lr=0.1)}, {"llm": model})
    norms, total = clip_grad_norms(optimizer, {"llm": limit}, None)
    close("returned norm", norms["llm"], ref_norm, problems)
    close("returned total", total, ref_norm, problems)
    torch.nn.utils.clip_grads_with_norm_(ref_params, limit, ref_norm)
    for name, param in model.named_parameters():
        close(f"{name} clipped", param.grad.full_tensor(), refs[name].grad, problems)
    clip_grad_norms(optimizer, {"llm": 0.0}, limit / 2)  # global: the one module by the combined norm
    torch.nn.utils.clip_grad_norm_(ref_params, limit / 2)
    for name, param in model.named_parameters():
        close(f"{name} clipped globally", param.grad.full_tensor(), refs[name].grad, problems)
    with open(os.path.join(out_dir, f"rank{dist.get_rank()}.json"), "w") as f:
        json.dump({"placements": placements, "problems": problems, "clipped": float(ref_norm) > limit}, f)
    end_distributed()


if __name__ == "__main__":
    main(sys.argv[1])
