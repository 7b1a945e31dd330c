"""Checkpoints at scale, 4 gloo ranks, one launch (`accelerate launch --multi_gpu --num_processes 4`): a model with
an 8 MB LLM (tensors up to 1 MiB), trained one step through OmniPlugin, saved, resumed and exported in two layouts
(LLM full shard over 4 with a replicated (DDP) vision tower; LLM HSDP 2 x 2 with the vision tower full shard, built
with `empty_init` from a saved folder).
Records per rank, during each save, export and load: the bytes received through collectives (`ReceivedBytes`), the
bytes written (`wchar` of /proc/<pid>/io, the rank's process and its writer process), hashed (`verify_checkpoint`) and read (the safetensors readers); after them, rank 0 checks
each module folder against what transformers' own `save_pretrained` writes for the same tensors (file names, keys
per file, dtypes, shapes) and its values against the gathered state; a resumed run (other initial weights, under full shard) takes
one more step bitwise equal to the straight run; hf_omni's side groups are counted. Then the saved model built with
`empty_init` with every module whole on every rank (ddp): the bytes each rank read per module while it was filled
(in stripes). Usage: mp_scale.py OUT_DIR"""

import json
import os
import sys

import torch
import torch.distributed as dist
from helpers import full_state, save_every_rank, tiny_data
from launching import end_distributed

from hf_omni import OmniPlugin
from hf_omni.checkpoint import digests
from hf_omni.testing.collectives import ReceivedBytes
from hf_omni.testing.digits import Captioner, build_model
from hf_omni.testing.reads import count_reads

HSDP = {"dp_replicate_size": 2, "dp_shard_size": 2}
LAYOUTS = {  # HSDP first: its empty_init fill is the first thing that agrees, before any checkpointer exists
    "hsdp": {"vision": {"parallel": "fsdp"}, "projector": {"parallel": "ddp"},
             "llm": {"parallel": "fsdp", "parallelism": HSDP}},
    "full_shard": {"vision": {"parallel": "ddp"}, "projector": {"parallel": "ddp"}, "llm": {"parallel": "fsdp"}},
}
EXPORT_SHARD = "1MB"  # several safetensors files per module, and an index
READ = count_reads()  # bytes hf_omni's and DCP's safetensors readers request
digests.PIECE = 2**20  # files hashed in pieces of 1 MiB (`verify_checkpoint`): several per weights file


TIMEOUT = 321  # ddp_timeout, seconds
SIDE_GROUPS = []  # (thread name, timeout) of every group hf_omni.core.dist creates


def count_side_groups() -> None:
    import threading

    original = dist.new_group

    def new_group(*args, **kwargs):
        if sys._getframe(1).f_globals.get("__name__") == "hf_omni.core.dist":
            timeout = kwargs.get("timeout")
            SIDE_GROUPS.append((threading.current_thread().name, timeout.total_seconds() if timeout else None))
        return original(*args, **kwargs)

    dist.new_group = new_group


class Hashed:
    """Bytes this rank hashed (`verify_checkpoint`'s pieces) while active."""

    def __enter__(self):
        self.bytes, self.original = 0, digests.piece_sha256

        def counted(path, offset, length):
            self.bytes += length
            return self.original(path, offset, length)

        digests.piece_sha256 = counted
        return self

    def __exit__(self, *exc):
        digests.piece_sha256 = self.original


def model(seed: int = 0):
    return build_model(hidden=64, layers=2, llm_hidden=256, llm_layers=2, seed=seed)


SOURCE = []  # the folder the HSDP layout's model is read from with `empty_init`


def save_source(out_dir: str) -> None:
    SOURCE.append(os.path.join(out_dir, "source"))
    if dist.get_rank() == 0:
        model().save_pretrained(SOURCE[0])
    dist.barrier()


OPENED = []  # every file opened through safetensors.safe_open (a header read), in order


def count_opens() -> None:
    import safetensors

    original = safetensors.safe_open

    def counted(*args, **kwargs):
        OPENED.append(str(kwargs.get("filename", args[0] if args else None)))
        return original(*args, **kwargs)

    safetensors.safe_open = counted


def wchar(pid: str) -> int:
    with open(f"/proc/{pid}/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("wchar:"))


def written() -> int:
    """Bytes written by this rank: its process and its children (the writer process of its async saves)."""
    children = []
    for task in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{task}/children") as f:
            children += f.read().split()
    return wchar("self") + sum(wchar(pid) for pid in children)


def measured(fn) -> dict:
    dist.barrier()
    before, read, opened = written(), READ["bytes"], len(OPENED)
    with ReceivedBytes() as received, Hashed() as hashed:
        fn()
    return {"received": received.total, "by_name": dict(received.by_name), "written": written() - before,
            "hashed": hashed.bytes, "read": READ["bytes"] - read, "opened": OPENED[opened:]}


def prepared(layout: str, out: str, seed: int):
    from accelerate import Accelerator

    defaults = {"learning_rate": 1e-3, "verify_checkpoint": True, "ddp_timeout": TIMEOUT,
                "save_async": layout == "hsdp"}  # (the HSDP layout saves in the background)
    plugin = OmniPlugin(modules=LAYOUTS[layout], defaults=defaults, output_dir=out)
    accelerator = Accelerator(cpu=True)
    built = model(seed) if layout != "hsdp" else Captioner.from_pretrained(SOURCE[0], empty_init=True)  # (read as
    composed, optimizer, scheduler = plugin.prepare(accelerator, built, num_training_steps=4)  # it is sharded)
    return plugin, composed, optimizer, scheduler


def step(composed, optimizer, scheduler, number: int) -> None:
    data, rank = tiny_data(composed, 64), dist.get_rank()
    rows = [data[i] for i in range(number * 16 + rank * 4, number * 16 + rank * 4 + 4)]
    batch = {key: torch.stack([row[key] for row in rows]) for key in rows[0]}
    composed(**batch).loss.backward()
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad()


def folder_mismatches(folder: str, slot, state: dict, max_shard_size: str = "50GB") -> list[str]:
    """Rank 0: `folder` against what transformers' own `save_pretrained` writes from the module's gathered `state`
    (`state_dict=`), file by file: names, keys, header metadata, tensors, the index and generation config; and
    loaded back with the module's class."""
    import tempfile

    from safetensors import safe_open

    from hf_omni.formats.transformers_classes import original_class, save_view

    problems = []
    with tempfile.TemporaryDirectory() as reference:
        view = save_view(slot.module)  # transformers pops what it writes from `state_dict`: a copy
        view.save_pretrained(reference, state_dict=dict(state), max_shard_size=max_shard_size)
        os.remove(os.path.join(reference, "config.json"))  # (the wrapper's class and live dtype: checked elsewhere)
        for name in sorted(n for n in os.listdir(reference) if n.endswith((".safetensors", ".json"))):
            mine = os.path.join(folder, name)
            if not os.path.exists(mine):
                problems.append(f"{name}: missing")
            elif name.endswith(".json"):
                if json.load(open(mine)) != json.load(open(os.path.join(reference, name))):
                    problems.append(f"{name}: differs")
            else:
                with safe_open(mine, "pt") as a, safe_open(os.path.join(reference, name), "pt") as b:
                    if sorted(a.keys()) != sorted(b.keys()) or a.metadata() != b.metadata():
                        problems.append(f"{name}: keys or metadata")
                    problems += [f"{name}:{k}: tensor" for k in b.keys() if k in a.keys()
                                 and not torch.equal(a.get_tensor(k), b.get_tensor(k))]
        extra = set(n for n in os.listdir(folder) if n.endswith(".safetensors")) - set(os.listdir(reference))
        problems += [f"{name}: extra" for name in sorted(extra)]
    with open(os.path.join(folder, "config.json")) as f:
        if json.load(f)["architectures"] != [original_class(slot.module).__name__]:
            problems.append("config.json: architectures")
    loaded = original_class(slot.module).from_pretrained(folder).state_dict()
    problems += [f"{k}: loaded value" for k, v in state.items() if k in loaded and not torch.equal(loaded[k], v)]
    return problems


def module_states(state: dict, prefix: str) -> dict:
    return {k[len(prefix) + 1:]: v for k, v in state.items() if k.startswith(prefix + ".")}


def disk_bytes(directory: str) -> int:
    return sum(os.path.getsize(os.path.join(d, n)) for d, _, names in os.walk(directory) for n in names)


def run(layout: str, out_dir: str) -> dict:
    out = os.path.join(out_dir, layout)
    plugin, composed, optimizer, scheduler = prepared(layout, out, seed=0)
    step(composed, optimizer, scheduler, 0)
    checkpoint = os.path.join(out, "checkpoint-1")
    result = {"save": measured(lambda: (plugin.save_state(checkpoint, step=1), plugin.wait_for_save()))}
    export = os.path.join(out, "export")
    result["export"] = measured(lambda: composed.save_pretrained(export, max_shard_size=EXPORT_SHARD))
    state = full_state(composed)
    result["module_bytes"] = {name: sum(p.numel() * p.element_size() for p in module_states(state, name).values())
                              for name in LAYOUTS[layout]}
    if dist.get_rank() == 0:
        result["checkpoint_bytes"] = disk_bytes(checkpoint)
        with open(os.path.join(checkpoint, "hf_omni_checkpoint.json")) as f:
            result["listed_bytes"] = sum(json.load(f)["files"].values())
        result["mismatches"] = {}
        for name, slot in composed.slots.items():
            expected = module_states(state, name)
            result["mismatches"][f"checkpoint/{name}"] = folder_mismatches(os.path.join(checkpoint, name), slot,
                                                                          expected)
            result["mismatches"][f"export/{name}"] = folder_mismatches(os.path.join(export, name), slot, expected,
                                                                      EXPORT_SHARD)
        result["export_files"] = sorted(os.listdir(os.path.join(export, "llm")))
    step(composed, optimizer, scheduler, 1)
    straight = full_state(composed)
    plugin.close()
    plugin, resumed, optimizer, scheduler = prepared(layout, os.path.join(out_dir, layout + "_resumed"), seed=1)
    result["load"] = measured(lambda: plugin.load_state(checkpoint))
    step(resumed, optimizer, scheduler, 1)
    again = full_state(resumed)
    result["resume_mismatch"] = [k for k in straight if not torch.equal(straight[k], again[k])]
    plugin.close()
    result["corrupted"] = resume_corrupted(layout, out_dir, checkpoint)
    return result


def resume_corrupted(layout: str, out_dir: str, checkpoint: str) -> str:
    """One byte of the LLM's weights changed in the middle of the file (size kept): the error each rank raises."""
    path = os.path.join(checkpoint, "llm", "model.safetensors")
    dist.barrier()
    if dist.get_rank() == 0:
        with open(path, "r+b") as f:
            f.seek(os.path.getsize(path) // 2)
            byte = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([byte[0] ^ 1]))
    dist.barrier()
    plugin, _, _, _ = prepared(layout, os.path.join(out_dir, layout + "_corrupted"), seed=1)
    try:
        plugin.load_state(checkpoint)
    except Exception as err:  # every rank: the same error
        return f"{type(err).__name__}: {err}"
    return "loaded"


LORA = {"vision": {"parallel": "ddp"}, "projector": {"parallel": "ddp"},
        "llm": {"parallel": "fsdp", "lora": {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"],
                                             "use_dora": True, "modules_to_save": ["lm_head"]}}}


def merged_lora_export(out_dir: str) -> dict:
    """The LLM with LoRA, fully sharded, one step, exported with `merge_lora`: what each rank received, and on rank
    0 the largest difference of every written tensor from PEFT's own merge of the gathered module."""
    from accelerate import Accelerator
    from safetensors.torch import load_file

    from hf_omni.files.peft_merge import merged_module

    out = os.path.join(out_dir, "lora")
    plugin = OmniPlugin(modules=LORA, defaults={"learning_rate": 1e-2}, output_dir=out)
    composed, optimizer, scheduler = plugin.prepare(Accelerator(cpu=True), model(), num_training_steps=4)
    step(composed, optimizer, scheduler, 0)
    export = os.path.join(out, "export")
    result = {"export": measured(lambda: composed.save_pretrained(export, merge_lora=True))}
    state = module_states(full_state(composed), "llm")
    if dist.get_rank() == 0:
        expected = merged_module(composed.llm, state).state_dict()
        written = load_file(os.path.join(export, "llm", "model.safetensors"))
        result["keys_equal"] = sorted(written) == sorted(expected)
        result["max_diff"] = max((written[k] - expected[k]).abs().max().item() for k in written)
        result["adapter_files"] = sorted(n for n in os.listdir(os.path.join(export, "llm")) if "adapter" in n)
    plugin.close()
    return result


def moe_rows(out_dir: str) -> dict:
    """A Mixtral LLM of 4 experts saved as transformers saves it (one file tensor per expert), built with
    `empty_init` and fully sharded over the 4 ranks (one expert each): what each rank read while it was filled (its
    rows, its expert's file tensors only, never a full copy through transformers' loading), and on rank 0 whether
    the gathered module equals transformers' own load, bitwise."""
    from accelerate import Accelerator
    from transformers import MixtralConfig, MixtralForCausalLM

    from hf_omni import OmniModel
    from hf_omni.files import weights

    folder = os.path.join(out_dir, "moe")
    if dist.get_rank() == 0:
        torch.manual_seed(0)
        config = MixtralConfig(vocab_size=64, hidden_size=64, intermediate_size=256, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                               num_experts_per_tok=2)
        OmniModel.from_modules({"llm": MixtralForCausalLM(config)}).save_pretrained(folder)
    dist.barrier()

    def refuse(*args, **kwargs):
        raise AssertionError("a full copy of the module through transformers' loading")

    weights.read_through_transformers = refuse
    plugin = OmniPlugin(modules={"llm": {"parallel": "fsdp"}}, defaults={"learning_rate": 1e-3},
                        output_dir=os.path.join(out_dir, "moe_run"))
    built = OmniModel.from_pretrained(folder, empty_init=True)
    result = {"fill": measured(lambda: plugin.prepare_modules(Accelerator(cpu=True), built))}
    state = module_states(full_state(built), "llm")
    if dist.get_rank() == 0:
        loaded = MixtralForCausalLM.from_pretrained(os.path.join(folder, "llm")).state_dict()
        result["equal"] = sorted(state) == sorted(loaded) and all(torch.equal(state[k], loaded[k]) for k in state)
        result["experts"] = sorted(k for k in state if ".experts." in k)
        result["file_bytes"] = os.path.getsize(os.path.join(folder, "llm", "model.safetensors"))
    plugin.close()
    return result


def striped_fill(out_dir: str) -> dict:
    """The saved model built with `empty_init` and prepared with every module whole on every rank (ddp; the
    vision tower frozen, unwrapped): the bytes this rank read for each module while it was filled, each module's
    file bytes and largest tensor, and on rank 0 whether the filled model equals the saved one, bitwise."""
    from accelerate import Accelerator

    from hf_omni.parallel import driver

    by_module, fill = {}, driver.fill_module

    def counted(module, folder, device, name="", **kwargs):
        before = READ["bytes"]
        out = fill(module, folder, device, name, **kwargs)
        by_module[name] = READ["bytes"] - before
        return out

    driver.fill_module = counted
    modules = {"vision": {"trainable": False}, "projector": {"parallel": "ddp"}, "llm": {"parallel": "ddp"}}
    plugin = OmniPlugin(modules=modules, defaults={"learning_rate": 1e-3}, output_dir=os.path.join(out_dir, "ddp"))
    built = Captioner.from_pretrained(SOURCE[0], empty_init=True)
    result = {"fill": measured(lambda: plugin.prepare_modules(Accelerator(cpu=True), built)), "read": by_module}
    driver.fill_module = fill
    source = model().state_dict()
    result["file_bytes"] = {name: sum(os.path.getsize(os.path.join(SOURCE[0], name, f)) for f in os.listdir(
        os.path.join(SOURCE[0], name)) if f.endswith(".safetensors")) for name in modules}
    result["largest"] = {name: max(v.numel() * v.element_size() for k, v in source.items() if k.startswith(name + "."))
                         for name in modules}
    state = built.state_dict()
    result["mismatch"] = [k for k, v in source.items() if not torch.equal(state[k], v)]
    plugin.close()
    return result


def main(out_dir: str):
    dist.init_process_group("gloo")  # (Accelerate's state takes it over)
    count_side_groups()
    count_opens()
    save_source(out_dir)
    results = {layout: run(layout, out_dir) for layout in LAYOUTS}
    results["lora_merge"] = merged_lora_export(out_dir)
    results["moe_rows"] = moe_rows(out_dir)
    results["striped"] = striped_fill(out_dir)
    results["side_groups"] = SIDE_GROUPS
    save_every_rank(results, os.path.join(out_dir, "results.json"),
                    lambda everyone, path: open(path, "w").write(json.dumps(everyone, indent=1)))


if __name__ == "__main__":
    main(sys.argv[1])
    end_distributed()
