"""Saves and merged exports of an offloaded module (FSDP2 `cpu_offload`), at 2 gloo ranks: a Mixtral LLM of 4
experts (fused in memory, one file tensor per expert: a derived group gathered on its writer) with LoRA on q_proj /
v_proj (lora_A gathered whole on every rank for a merged export).

- `exports`: the merged export, read back with transformers, against PEFT's own merge of the gathered module.
- `devices`: the device each collective of those paths received, with the group's device set to `meta` (on a
  CPU-only machine the group's device is the CPU, where the shards live already: `meta` stands for the accelerator
  under NCCL, so that a tensor handed over unmoved shows). The first collective of each path stops it (a meta
  tensor holds no values): the derived group's `dist.gather` (plain save), `lora_A`'s `full_tensor` (merged
  export), and a `Shard(1)` DTensor's redistribution to rows (`as_rows`).
- `failure`: the module without LoRA saved (4 derived groups, converted by ranks 0, 1, 0, 1), rank 1's first
  conversion (the second group's) failing while rank 0 goes on to the third group's gathers: what each rank raised,
  and in how long.

Usage: mp_offload_save.py OUT_DIR"""

import json
import os
import sys
import time

import torch
import torch.distributed as dist
from helpers import full_state, save_every_rank
from launching import end_distributed
from transformers import MixtralConfig, MixtralForCausalLM

from hf_omni import OmniModel, OmniPlugin

LLM = {"parallel": "fsdp", "fsdp_plugin": {"cpu_offload": True},
       "lora": {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]}}


class Stop(Exception):
    """A collective reached (with a meta tensor: nothing to compute)."""


def prepared(out_dir: str, lora: bool = True):
    from accelerate import Accelerator

    torch.manual_seed(0)
    config = MixtralConfig(vocab_size=32, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
                           num_attention_heads=2, num_key_value_heads=1, num_local_experts=4, num_experts_per_tok=2)
    llm = LLM if lora else {k: v for k, v in LLM.items() if k != "lora"}
    plugin = OmniPlugin(modules={"llm": llm}, defaults={"learning_rate": 1e-2}, output_dir=out_dir)
    composed, optimizer, _ = plugin.prepare(Accelerator(cpu=True), OmniModel.from_modules(
        {"llm": MixtralForCausalLM(config)}), num_training_steps=2)
    ids = torch.randint(0, 32, (2, 6))
    composed.llm(input_ids=ids, labels=ids).loss.backward()  # LoRA's B leaves 0: the merge changes the weights
    optimizer.step()
    return plugin, composed


def exports(composed, out_dir: str) -> dict:
    """The merged export read back with transformers against PEFT's own merge of the gathered module (the plain
    save runs too: its files are other tests' subject)."""
    from hf_omni.files.peft_merge import merged_module

    merged = os.path.join(out_dir, "merged")
    composed.save_pretrained(os.path.join(out_dir, "saved"))
    composed.save_pretrained(merged, merge_lora=True)
    state = {k.removeprefix("llm."): v for k, v in full_state(composed).items() if k.startswith("llm.")}
    if dist.get_rank() != 0:
        return {}
    expected = merged_module(composed.llm, state).state_dict()
    written = MixtralForCausalLM.from_pretrained(os.path.join(merged, "llm")).state_dict()
    return {"keys_equal": sorted(written) == sorted(expected), "experts": sum(".experts." in k for k in written),
            "max_diff": max((written[k] - expected[k]).abs().max().item() for k in written),
            "lora_b": max(v.abs().max().item() for k, v in state.items() if ".lora_B." in k)}


def devices(composed, out_dir: str) -> dict:
    """What each path's first collective received, with the group's device set to meta."""
    import hf_omni.shards.device
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch.distributed.tensor import init_device_mesh
    from torch.utils._python_dispatch import TorchDispatchMode

    from hf_omni.shards.box import as_rows

    seen, original_gather, original_device = [], dist.gather, hf_omni.shards.device.group_device

    class Functional(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.namespace == "_c10d_functional" and "wait" not in func.__name__:
                seen.append((func.__name__.split(".")[0], str(args[0].device)))
                raise Stop
            return func(*args, **(kwargs or {}))

    def gather(tensor, *args, **kwargs):
        seen.append(("gather", str(tensor.device)))
        raise Stop

    out = {}
    dist.gather = gather
    hf_omni.shards.device.group_device = lambda mesh: torch.device("meta")
    try:
        for name, call in (("save", lambda: composed.save_pretrained(os.path.join(out_dir, "meta_saved"))),
                           ("merged", lambda: composed.save_pretrained(os.path.join(out_dir, "meta_merged"),
                                                                       merge_lora=True)),
                           ("as_rows", lambda: as_rows(distribute_tensor(torch.ones(4, 4), init_device_mesh(
                               "cpu", (2,)), [Shard(1)])))):
            seen.clear()
            try:
                with Functional():
                    call()
            except Exception as err:  # noqa: BLE001 - Stop, or the agreement's RankFailure around it
                out[name] = {"seen": list(seen), "stopped": isinstance(err, Stop) or "Stop" in str(err)}
    finally:
        dist.gather, hf_omni.shards.device.group_device = original_gather, original_device
    return out


def failure(out_dir: str) -> dict:
    """The module without LoRA: 4 derived groups, converted by ranks 0, 1, 0, 1."""
    import hf_omni.files.folder_derived as derived

    plugin, composed = prepared(os.path.join(out_dir, "plain"), lora=False)
    original, calls = derived.weights_keys, [0]

    def convert(module, state):
        calls[0] += 1
        if calls[0] == 1:
            raise RuntimeError("conversion failed here")
        return original(module, state)

    if dist.get_rank() == 1:
        derived.weights_keys = convert
    start = time.monotonic()
    try:
        composed.save_pretrained(os.path.join(out_dir, "failed"))
        raised = "no error"
    except Exception as err:  # noqa: BLE001 - what each rank raised
        raised = f"{type(err).__name__}: {err}"
    derived.weights_keys = original
    plugin.close()
    return {"raised": raised, "seconds": time.monotonic() - start, "conversions": calls[0]}


def main(out_dir: str):
    plugin, composed = prepared(out_dir)
    results = {"offloaded": next(p for p in composed.llm.parameters()).to_local().device.type,
               "exports": exports(composed, out_dir), "devices": devices(composed, out_dir)}
    plugin.close()
    results["failure"] = failure(out_dir)
    save_every_rank(results, os.path.join(out_dir, "results.json"),
                    lambda everyone, path: open(path, "w").write(json.dumps(everyone, indent=1)))
    end_distributed(0)


if __name__ == "__main__":
    main(sys.argv[1])
