"""2 gloo ranks under the toy column-sharding strategy (tests/toy_strategy.py, `parallel: fsdp_dim1`), one launch:
the box of uneven Shard(d) tensors and their dim-0 view; replicas of a `Shard(1)` tensor read once; a run of 4 steps
saving at 2 and 4 (async) and exporting with LoRA merged; the same run under `parallel: fsdp`; a resume from its step-2
checkpoint; an `empty_init` run reading each rank's columns. Rank 0 writes every rank's results to OUT_DIR/toy.pt.

Usage: mp_toy_strategy.py OUT_DIR"""

import os
import sys

import toy_strategy  # noqa: F401 (registers `parallel: fsdp_dim1`)
import torch
import torch.distributed as dist
from helpers import empty_init_model, full_state, make_args, save_every_rank, step_losses, tiny_data, tiny_model
from launching import end_distributed
from toy_scenario import EMPTY_INIT_MODULES, modules

from hf_omni import OmniTrainer


def box_checks() -> list:
    """(shape, dim, box equals the local shard, dim-0 view equals its rows) of uneven tensors on 2 ranks (dims not
    divisible by 2, and fewer columns than ranks)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from hf_omni.shards.box import as_rows, local_box, local_rows

    mesh, out = init_device_mesh("cpu", (dist.get_world_size(),)), []
    for shape in ((5, 3), (3, 1), (2, 5, 3)):
        full = torch.arange(torch.Size(shape).numel(), dtype=torch.float32).reshape(shape)
        for dim in range(len(shape)):
            tensor = distribute_tensor(full, mesh, [Shard(dim)])
            rows = as_rows(tensor)
            lo, hi = local_rows(rows)
            out.append((shape, dim, torch.equal(full[local_box(tensor)], tensor.to_local()),
                        rows.placements == (Shard(0),) and torch.equal(full[lo:hi], rows.to_local())))
    return out


def replica_checks() -> dict:
    """HSDP-style replicas of a `Shard(1)` tensor on a (2 replicas, 1 shard) mesh: `read_once` has one replica read
    it, the other receive it; {rank that read: bool, received equals the file value: bool}."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from hf_omni.shards.box import copy_into, local_box
    from hf_omni.shards.replicas import read_once

    mesh = init_device_mesh("cpu", (dist.get_world_size(), 1), mesh_dim_names=("replicate", "shard"))
    full = torch.arange(15, dtype=torch.float32).reshape(3, 5)
    tensor = distribute_tensor(torch.zeros(3, 5), mesh, [Replicate(), Shard(1)])
    read = []
    read_once([tensor], lambda i: (read.append(i), copy_into(tensor, full[local_box(tensor)])), "replica check")
    return {"read": bool(read), "equal": torch.equal(tensor.to_local(), full[local_box(tensor)])}


class ReadLog:
    """(folder name, key, shape read, shape in the file) of every read of `SafetensorsIndex.read`."""

    def __init__(self):
        from hf_omni.files.safetensors_index import SafetensorsIndex

        self.reads, original = [], SafetensorsIndex.read

        def read(index, key, box=None):
            out = original(index, key, box)
            self.reads.append((os.path.basename(index.folder), key, tuple(out.shape), index.info(key)[0]))
            return out

        SafetensorsIndex.read = read


def trainer_for(out_dir, parallel, model=None, steps=4, save=True, **overrides):
    model = model if model is not None else tiny_model()
    args = make_args(out_dir, modules=modules(parallel), max_steps=steps, per_device_train_batch_size=4,
                     save_strategy="steps" if save else "no", save_steps=2, merge_lora_on_export=True, **overrides)
    return OmniTrainer(model=model, args=args, train_dataset=tiny_data(model, 48))


def placements(module) -> dict:
    """The placements of `module`'s matrices (2-D parameters)."""
    return {name: str(p.placements) for name, p in module.named_parameters() if p.ndim == 2}


def main(out_dir):
    from accelerate import PartialState

    PartialState()  # the process group (gloo), before the box checks
    results = {"world_size": dist.get_world_size(), "boxes": box_checks(), "replicas": replica_checks()}
    toy = trainer_for(os.path.join(out_dir, "toy"), "fsdp_dim1", save_async=True)  # checkpoints staged, then written
    toy.train()
    results["toy"] = (step_losses(toy), full_state(toy.model))
    results["wrapped"] = toy.plugin.wrapped
    results["placements"] = {name: placements(getattr(toy.model, name)) for name in ("vision", "projector", "llm")}
    toy.save_model(os.path.join(out_dir, "export"))
    fsdp = trainer_for(os.path.join(out_dir, "fsdp"), "fsdp", save=False)
    fsdp.train()
    results["fsdp"] = (step_losses(fsdp), full_state(fsdp.model))
    resumed = trainer_for(os.path.join(out_dir, "resumed"), "fsdp_dim1", save=False)
    resumed.train(resume_from_checkpoint=os.path.join(out_dir, "toy", "checkpoint-2"))
    results["resumed"] = (step_losses(resumed), full_state(resumed.model))
    os.environ["HF_OMNI_TEST_SAVED"] = os.path.join(out_dir, "saved")
    log = ReadLog()
    empty = OmniTrainer(model=empty_init_model(), args=make_args(
        os.path.join(out_dir, "empty"), modules=EMPTY_INIT_MODULES, max_steps=1, per_device_train_batch_size=4),
        train_dataset=tiny_data(tiny_model(), 48))
    empty.train()
    results["empty_init"] = (step_losses(empty), full_state(empty.model))
    results["empty_placements"] = placements(empty.model.llm)
    results["reads"] = log.reads
    save_every_rank(results, os.path.join(out_dir, "toy.pt"))


if __name__ == "__main__":
    main(*sys.argv[1:])
    end_distributed()
