"""Master weights at 2 gloo ranks (`accelerate launch --multi_gpu --num_processes 2`), one launch: the demo model
with its LLM saved in bf16, built with `empty_init`, the LLM sharded with FSDP2 under `bf16: true`. Records, per
rank: the dtypes FSDP2's collectives carried (parameters gathered in bf16, gradients reduced in fp32), the policy
applied for each way of writing `fsdp_plugin.mixed_precision`, the dtypes of the local shards and AdamW moments,
the full state at the step-2 checkpoint, and whether a resume from it in a model with other weights ends bitwise
equal to the straight run (and how often that resume read and broadcast each module's `state/` DCP metadata); the
same run from the model loaded whole (no `empty_init`): the bytes of fp32 masters each rank allocated while its
modules were prepared, and its final state, to compare with the `empty_init` run's (the frozen vision tower aside:
its pooler is not in its files, so each load initialises it afresh).
Usage: mp_master_weights.py OUT_DIR"""

import os
import sys

import torch
import torch.distributed as dist
from collective_dtypes import CollectiveDtypes
from helpers import full_state, make_args, save_every_rank, tiny_data, tiny_model
from transformers import TrainerCallback

from hf_omni import OmniTrainer
from hf_omni.compat import torch_dispatch_mode
from hf_omni.testing.digits import Captioner
from launching import end_distributed

LR = 1e-6
POLICIES = {"unset": None, "bf16": "bf16", "dict": {"param_dtype": "bfloat16", "reduce_dtype": "bfloat16"}}


class StateAtSave(TrainerCallback):
    """The model's full state (masters, gathered) at each save."""

    def __init__(self):
        self.states = {}

    def on_save(self, args, state, control, model=None, **kwargs):
        self.states[state.global_step] = full_state(model)


def saved_folder(out_dir: str) -> str:
    folder = os.path.join(out_dir, "bf16_llm")
    if dist.get_rank() == 0:
        model = tiny_model()
        model.llm.to(torch.bfloat16)
        model.save_pretrained(folder)
    dist.barrier()
    return folder


class MasterBytes(torch_dispatch_mode()):
    """Bytes of the float32 tensors cast from bf16 / fp16 ones on this rank while active (a DTensor: its local
    share)."""

    def __init__(self):
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if (func is torch.ops.aten._to_copy.default and args[0].dtype in (torch.bfloat16, torch.float16)
                and out.dtype == torch.float32):
            local = out.to_local() if hasattr(out, "to_local") else out
            self.bytes += local.numel() * local.element_size()
        return out


def counting_masters(counter: dict):
    """Every `OmniPlugin.prepare_modules` from now on adds to `counter["bytes"]` what `MasterBytes` counts."""
    from hf_omni import OmniPlugin

    original = OmniPlugin.prepare_modules

    def counted(self, *args, **kwargs):
        with MasterBytes() as cast:
            out = original(self, *args, **kwargs)
        counter["bytes"] += cast.bytes
        return out

    OmniPlugin.prepare_modules = counted


def run(folder: str, out: str, mixed_precision=None, seed: int = 0, resume: str | None = None, empty_init=True,
        **overrides):
    model = Captioner.from_pretrained(folder, empty_init=empty_init)
    fsdp = {"mixed_precision": mixed_precision} if mixed_precision is not None else {}
    args = dict(bf16=True, learning_rate=LR, max_steps=4, per_device_train_batch_size=4, save_strategy="steps",
                save_steps=2, modules={"vision": {"trainable": False}, "llm": {"parallel": "fsdp", "fsdp_plugin": fsdp}})
    args.update(overrides)
    saves = StateAtSave()
    trainer = OmniTrainer(model=model, args=make_args(out, **args), train_dataset=tiny_data(model, 64),
                          callbacks=[saves])
    with CollectiveDtypes() as collectives:
        trainer.train(resume_from_checkpoint=resume)
    return trainer, saves, sorted(collectives.seen)


class StateMetadataReads:
    """While active, this rank's readings of a `state/`'s DCP metadata (torch's `HuggingFaceStorageReader.
    read_metadata`: every shard header) and its metadata broadcasts (`ShardReader`'s `broadcast_object_list`), by
    folder relative to `root`."""

    def __init__(self, root: str):
        from torch.distributed.checkpoint import HuggingFaceStorageReader

        self.root, self.reader, self.reads, self.broadcasts = root, HuggingFaceStorageReader, {}, {}
        self.saved = HuggingFaceStorageReader.read_metadata, dist.broadcast_object_list

    def _count(self, counts: dict, path) -> None:
        folder = os.path.relpath(str(path), self.root)
        counts[folder] = counts.get(folder, 0) + 1

    def __enter__(self):
        read, broadcast = self.saved

        def counted_read(reader):
            self._count(self.reads, reader.path)
            return read(reader)

        def counted_broadcast(*args, **kwargs):
            caller = sys._getframe(1)
            if caller.f_code.co_filename.endswith("shard_reader.py"):
                self._count(self.broadcasts, caller.f_locals["self"].path)
            return broadcast(*args, **kwargs)

        self.reader.read_metadata, dist.broadcast_object_list = counted_read, counted_broadcast
        return self

    def __exit__(self, *exc):
        self.reader.read_metadata, dist.broadcast_object_list = self.saved


def main(out_dir: str):
    dist.init_process_group("gloo")  # (Accelerate's state takes it over)
    folder = saved_folder(out_dir)
    results = {"policies": {}}
    for name, setting in POLICIES.items():
        trainer, _, seen = run(folder, os.path.join(out_dir, f"policy_{name}"), setting, max_steps=1,
                               save_strategy="no")
        policy = trainer.plugin.fsdp_plugins["llm"].mixed_precision_policy
        results["policies"][name] = {"param": str(policy.param_dtype), "reduce": str(policy.reduce_dtype),
                                     "collectives": seen}
    straight, saves, _ = run(folder, os.path.join(out_dir, "straight"))
    llm = straight.model.llm
    q = llm.model.layers[0].self_attn.q_proj.weight
    adam = straight.optimizer.optimizers["llm"].state[q]
    results["shards"] = {"sharded": hasattr(q, "to_local"), "local": str(q.to_local().dtype),
                         "exp_avg": str(adam["exp_avg"].to_local().dtype)}
    results["at_save"] = saves.states[2]
    final = full_state(straight.model)
    with StateMetadataReads(os.path.join(out_dir, "straight", "checkpoint-2")) as metadata:
        resumed, _, _ = run(folder, os.path.join(out_dir, "resumed"), resume=os.path.join(out_dir, "straight",
                                                                                        "checkpoint-2"))
    results["metadata"] = {"reads": metadata.reads, "broadcasts": metadata.broadcasts}
    again = full_state(resumed.model)
    results["resume_mismatch"] = [k for k in final if not torch.equal(final[k], again[k])]
    results["final"] = final
    cast = {"bytes": 0}
    counting_masters(cast)
    loaded, _, _ = run(folder, os.path.join(out_dir, "loaded"), empty_init=False)
    results["loaded"] = {"master_bytes": cast["bytes"], "mismatch": [k for k, v in full_state(loaded.model).items()
                                                                     if not k.startswith("vision.")
                                                                     and not torch.equal(final[k], v)]}
    trainable = [p.numel() * 4 for p in loaded.model.llm.parameters() if p.requires_grad]  # (DTensors: in full)
    results["loaded"].update(llm_bytes=sum(trainable), largest=max(trainable))
    save_every_rank(results, os.path.join(out_dir, "results.pt"))


if __name__ == "__main__":
    main(sys.argv[1])
    end_distributed()
