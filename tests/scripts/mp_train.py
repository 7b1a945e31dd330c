"""Run under `accelerate launch --multi_gpu --num_processes 2` (gloo, use_cpu): many scenarios per launch.

Usage: mp_train.py OUT_DIR [SCENARIO ...]. Rank 0 writes OUT_DIR/<scenario>.pt with the step losses, the final
full weights and facts about the wrapping; the test compares them with single-process runs of the same scenarios.
"""

import os
import sys

import helpers
import torch
import torch.distributed as dist
from helpers import full_state
from mp_scenarios import FSDP_ENV, SCENARIOS, sharding_facts
from transformers import TrainerCallback

from hf_omni import OmniTrainer
from launching import end_distributed


class GatheredProbe(TrainerCallback):
    """Whether the llm's decoder-layer parameters are gathered (plain tensors, not DTensor shards) after a
    micro-step inside an accumulation window, and after each optimizer step."""

    def __init__(self, model):
        self.model, self.in_window, self.after_step = model, [], []

    def _gathered(self):
        param = next(self.model.llm.model.layers[0].parameters())
        return not hasattr(param, "to_local")

    def on_substep_end(self, *args, **kwargs):
        self.in_window.append(self._gathered())

    def on_step_end(self, *args, **kwargs):
        self.after_step.append(self._gathered())


class ReadLog:
    """Records every tensor read from safetensors by empty_init loading: (key, shape read, full shape)."""

    def __init__(self):
        from hf_omni.files.weights import SafetensorsIndex

        self.reads, original = [], SafetensorsIndex.read

        def read(index, key, rows=None):
            out = original(index, key, rows)
            self.reads.append((key, tuple(out.shape), tuple(index.where[key].get_slice(key).get_shape())))
            return out

        SafetensorsIndex.read = read


class HashedBytes:
    """How many hashes of module tensors, weight files or dataset rows this rank computed for offline caches'
    fingerprints."""

    def __init__(self):
        from hf_omni.offline import cache

        self.calls = 0
        for name in ("tensors_hash", "files_hash", "dataset_hash"):
            setattr(cache, name, self.counted(getattr(cache, name)))

    def counted(self, fn):
        def wrapper(*args, **kwargs):
            self.calls += 1
            return fn(*args, **kwargs)

        return wrapper


def main(out_dir: str, names: list[str]):
    os.environ.update(FSDP_ENV)  # must change nothing
    os.environ["HF_OMNI_TEST_SAVED"] = os.path.join(out_dir, "saved")
    reads, hashed = ReadLog(), HashedBytes()
    for name in names:
        spec = SCENARIOS[name]
        reads.reads.clear()
        hashed.calls = 0
        model = getattr(helpers, spec["model"])()
        data = helpers.tiny_data(model)
        args = helpers.make_args(os.path.join(out_dir, name), **spec["multi"])
        probe = GatheredProbe(model)
        trainer = OmniTrainer(model=model, args=args, train_dataset=data, callbacks=[probe])
        trainer.train()
        plugins = trainer.plugin.fsdp_plugins
        facts = {
            "wrapped": dict(trainer.plugin.wrapped),
            "classes": {n: type(m).__name__ for n, m in model.omni_modules().items()},
            "model_class": type(model).__name__,
            "llm_isinstance": isinstance(model.llm, type(helpers.tiny_model().llm)),
            "fsdp_plugins": {n: {"wrap": p.transformer_cls_names_to_wrap, "reshard": p.reshard_after_forward,
                                 "mp": str(p.mixed_precision_policy), "id": id(p)} for n, p in plugins.items()},
            "world_size": dist.get_world_size(),
            "optimized": sorted(trainer.plugin.optimizer.optimizers),
            "requires_grad": {n: any(p.requires_grad for p in m.parameters()) for n, m in model.omni_modules().items()},
            "gathered": {"in_window": probe.in_window, "after_step": probe.after_step},
            "env": {k: os.environ.get(k) for k in FSDP_ENV},
            "sharding": sharding_facts(model),
            "reads": list(reads.reads),
            "fsdp_units": {n: sum(hasattr(m, "unshard") for m in module.modules())
                           for n, module in model.omni_modules().items()},
            "fingerprint_hashes": [None] * dist.get_world_size(),  # per rank
        }
        dist.all_gather_object(facts["fingerprint_hashes"], hashed.calls)
        state = full_state(model)
        trainer.save_model(os.path.join(out_dir, name, "export"))
        if dist.get_rank() == 0:
            torch.save({"losses": helpers.step_losses(trainer), "state": state, "facts": facts},
                       os.path.join(out_dir, f"{name}.pt"))
        dist.barrier()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:] or list(SCENARIOS))
    end_distributed()
