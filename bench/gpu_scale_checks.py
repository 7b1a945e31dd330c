"""GPU checklist checks of memory at scale (registered into bench/gpu_check.py's order, bench/checklist.py's runner).

- `accumulation_peak_memory`: a ~1B Llama, FSDP2 with bf16 compute: the peak with gradient_accumulation_steps 4
  against 1 at the same micro-batch.
- `fake_world_512_memory`: one rank of 512 (torch's fake process group: collectives move nothing, every buffer a
  rank of 512 allocates is allocated), in a process of its own: two Llama-3-70B decoder layers, then one
  Mixtral-8x7B decoder layer with its experts spread over 8 ranks, each prepared by hf_omni's own driver (the weight
  read replaced by a random fill of the local shards; expert parallelism's token counts mirrored), one forward,
  backward and AdamW step; peak memory against the per-rank formula of the check.
- `fake_world_steps`: a fake world of 2 for `sync_free_steps` at one GPU (bench/gpu_check.py).

    python bench/gpu_scale_checks.py --fake-world llama70b|mixtral|steps   # one run, one JSON line (as the checks)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import torch
from checklist import CUDA, RANK, WORLD, check

FAKE_WORLD, MARGIN, TOKENS, BATCH_FAKE = 512, 1.25, 8, 4  # TOKENS: batch 1; BATCH_FAKE: fake_world_steps' rows
BF16 = {"param_dtype": "bfloat16", "reduce_dtype": "float32"}  # FSDP2's policy in hf_omni's bf16 runs
MODELS = {  # the module each fake-world run trains, and its modules' settings
    "llama70b": {"family": "llama", "layers": 2, "hidden": 8192, "intermediate": 28672, "heads": 64, "kv_heads": 8,
                 "parallelism": None},
    "mixtral": {"family": "mixtral", "layers": 1, "hidden": 4096, "intermediate": 14336, "heads": 32, "kv_heads": 8,
                "parallelism": {"dp_shard_size": FAKE_WORLD, "ep_size": 8}},  # experts: 8 ep x 64 efsdp
}
# accumulation_peak_memory's Llama: ~1B on a GPU (`ACCUMULATION_TINY = True`: a tiny one, to run its path on CPU)
ACCUMULATION_TINY = os.environ.get("HF_OMNI_ACCUMULATION_TINY") == "1"
ACCUMULATION_LLAMA = (
    {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
     "num_key_value_heads": 4, "vocab_size": 256} if ACCUMULATION_TINY else
    {"hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 16, "num_attention_heads": 16,
     "num_key_value_heads": 16, "vocab_size": 32000})
ACCUMULATION_BATCH, ACCUMULATION_LENGTH, ACCUMULATION_RATIO = 4, 512, 1.05


def rss(field: str) -> int:
    """A line of /proc/self/status in bytes (VmRSS: resident now; VmHWM: its peak since the last reset)."""
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith(field + ":"))


def reset_peak() -> int:
    """Start a peak measurement; returns the bytes held now (CUDA: allocated; CPU: resident, VmHWM reset)."""
    if CUDA:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        return torch.cuda.memory_allocated()
    with open("/proc/self/clear_refs", "w") as refs:  # resets VmHWM to VmRSS (Linux)
        refs.write("5")
    return rss("VmRSS")


def peak() -> int:
    if CUDA:
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated()
    return rss("VmHWM")


def build(spec: dict) -> torch.nn.Module:
    """The model of `spec` on the meta device, in bf16 (as a bf16 checkpoint loads); vocabulary 256 (a small root)."""
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        MixtralConfig,
        MixtralForCausalLM,
    )

    config_cls, model_cls = {"llama": (LlamaConfig, LlamaForCausalLM),
                             "mixtral": (MixtralConfig, MixtralForCausalLM)}[spec["family"]]
    config = config_cls(hidden_size=spec["hidden"], intermediate_size=spec["intermediate"],
                        num_hidden_layers=spec["layers"], num_attention_heads=spec["heads"],
                        num_key_value_heads=spec["kv_heads"], vocab_size=256, max_position_embeddings=64)
    with torch.device("meta"):
        return model_cls(config).to(torch.bfloat16)


def random_fill(module, folder, device, name=""):
    """The driver's weight read, replaced: the local shards allocated on `device` and filled at random (std 0.02;
    norms 1), the rotary tables computed there."""
    from hf_omni.files.empty_init import materialize

    materialize(module, device)
    with torch.no_grad():
        for key, param in module.named_parameters():
            local = param.to_local() if hasattr(param, "to_local") else param
            local.fill_(1.0) if "norm" in key else local.normal_(0, 0.02)
    rotary = module.model.rotary_emb
    with torch.device(device):
        module.model.rotary_emb = type(rotary)(rotary.config)
    return []


MIRRORED = []  # the tokens each mirrored count exchange routes (fake world, expert parallelism)


def mirror_count_exchange() -> None:
    """Expert parallelism exchanges its per-expert token counts with an even-split `all_to_all_single` into an
    uninitialised tensor, then sizes the token all-to-all by it; a fake collective leaves that tensor as allocated
    (garbage sizes where the allocator reuses memory). In this process every even-split all-to-all returns this
    rank's own counts: it receives as many tokens from each rank as it sends there (a balanced load)."""
    import torch.distributed as dist

    original = dist.all_to_all_single

    def mirrored(output, input, output_split_sizes=None, input_split_sizes=None, group=None, async_op=False):
        if output_split_sizes is None and input_split_sizes is None and output.shape == input.shape:
            output.copy_(input)
            MIRRORED.append(input.sum().item())
        return original(output, input, output_split_sizes, input_split_sizes, group=group, async_op=async_op)

    for module in [dist, *sys.modules.values()]:  # transformers imports it by name (now or later)
        if getattr(module, "all_to_all_single", None) is original:
            module.all_to_all_single = mirrored


def fake_world(which: str) -> dict:
    """One rank of FAKE_WORLD: `which` prepared by hf_omni's driver, one step; figures for the check."""
    import types

    import torch.distributed as dist

    from hf_omni import OmniModel, OmniPlugin
    from hf_omni.compat import init_fake_process_group
    from hf_omni.parallel import driver
    from hf_omni.tuning.modes import apply_training_modes

    spec, device = MODELS[which], torch.device("cuda", 0) if CUDA else torch.device("cpu")
    if CUDA:
        torch.cuda.set_device(device)
    model = OmniModel.from_modules({"llm": build(spec)})
    units = [model.llm.model.layers[0]]  # FSDP2's units: the decoder layers, and the experts under EP
    if spec["parallelism"]:
        units.append(model.llm.model.layers[0].mlp.experts)
    unit_params = {id(u): sum(p.numel() for p in u.parameters()) for u in units}
    if spec["parallelism"]:  # one rank holds 1 / ep of the experts; the layer's unit holds the rest
        ep = spec["parallelism"]["ep_size"]
        unit_params[id(units[1])] //= ep
        unit_params[id(units[0])] -= unit_params[id(units[1])] * ep
    params = sum(p.numel() for p in model.llm.parameters())
    settings = {"parallel": "fsdp", "fsdp_plugin": {"mixed_precision": BF16}}
    if spec["parallelism"]:
        settings["parallelism"] = spec["parallelism"]
    init_fake_process_group(0, FAKE_WORLD)
    try:
        OmniPlugin(modules={"llm": settings}).resolve(model)
        apply_training_modes(model.slots)
        model.slots["llm"].pend("(random)")  # empty_init's path: sharded on meta, then each rank fills its share
        accelerator = types.SimpleNamespace(device=device, mixed_precision="bf16",  # master_dtype auto: fp32
                                            prepare_model=lambda model, **kwargs: model)
        driver.fill_module = random_fill
        if spec["parallelism"]:
            mirror_count_exchange()
        held = reset_peak()
        started = time.perf_counter()
        driver.prepare_modules(accelerator, model, fsdp_scope="module")
        shards = {(p.to_local() if hasattr(p, "to_local") else p).dtype for p in model.llm.parameters()}
        local = sum((p.to_local() if hasattr(p, "to_local") else p).numel() for p in model.llm.parameters())
        optimizer = torch.optim.AdamW(model.llm.parameters(), lr=1e-5)
        ids = torch.randint(0, 256, (1, TOKENS), device=device)
        model.llm(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        measured, seconds = peak() - held, time.perf_counter() - started
    finally:
        dist.destroy_process_group()
    unit = max(unit_params.values())
    state = 16 * local  # fp32 master + fp32 gradient + 2 fp32 AdamW moments of this rank's shards
    transient = 10 * unit  # bf16: 2 units gathered (this + prefetched) 4U, its gradients 2U, fp32 reduce input 4U
    activations = 4 * TOKENS * spec["layers"] * (24 * spec["hidden"] + 6 * spec["intermediate"])
    return {"model": which, "params": params, "local": local, "unit": unit, "shards": sorted(map(str, shards)),
            "measured": measured, "bound": state + transient + activations, "state": state, "transient": transient,
            "activations": activations, "seconds": seconds, "mirrored": MIRRORED,
            "how": "max_memory_allocated" if CUDA else "VmHWM - VmRSS"}


def run_fake_world(which: str) -> dict:
    """`fake_world(which)` in a process of its own (one default process group a process; a clean peak)."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
                                                           "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT")
           and not k.startswith("TORCHELASTIC")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [os.path.dirname(os.path.abspath(__file__)),
                                                      env.get("PYTHONPATH")]))
    done = subprocess.run([sys.executable, os.path.abspath(__file__), "--fake-world", which], env=env, check=False,
                          capture_output=True, text=True)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode or not lines:
        sys.stderr.write(done.stderr[-4000:])
        last = (done.stderr.strip().splitlines() or [""])[-1]
        raise RuntimeError(f"fake world {which}: exit {done.returncode}: {last}")
    return json.loads(lines[-1])


class TextOnly:
    """Made on first use (an OmniModel subclass): the LLM alone, `input_ids` and `labels` in."""

    cls = None

    @classmethod
    def make(cls):
        from hf_omni import OmniModel

        if cls.cls is None:
            class LlmOnly(OmniModel):
                def forward(self, input_ids, labels=None, **kw):
                    return self.llm(input_ids=input_ids, labels=labels, **kw)
            cls.cls = LlmOnly
        return cls.cls


def accumulation_run(accumulation: int, folder: str) -> tuple[int, int]:
    """(peak bytes above what was held before, optimizer steps) of 2 optimizer steps of the Llama, FSDP2 with bf16
    compute, micro-batch ACCUMULATION_BATCH x ACCUMULATION_LENGTH, `accumulation` micro-steps a step."""
    from transformers import LlamaConfig, LlamaForCausalLM, PrinterCallback

    from hf_omni import OmniTrainer, OmniTrainingArguments

    torch.manual_seed(0)
    config = LlamaConfig(max_position_embeddings=ACCUMULATION_LENGTH, **ACCUMULATION_LLAMA)
    ids = torch.randint(0, config.vocab_size, (2 * accumulation * ACCUMULATION_BATCH * WORLD, ACCUMULATION_LENGTH))
    data = [{"input_ids": row, "labels": row} for row in ids]
    gc_collect()
    held = reset_peak()
    with torch.device("cuda" if CUDA else "cpu"):  # a GPU initialises 1B parameters in a blink
        llm = LlamaForCausalLM(config)
    model = TextOnly.make().from_modules({"llm": llm})
    args = OmniTrainingArguments(
        output_dir=folder, max_steps=2, per_device_train_batch_size=ACCUMULATION_BATCH,
        gradient_accumulation_steps=accumulation, lr_scheduler_type="constant", optim="adamw_torch",
        use_cpu=not CUDA, report_to="none", disable_tqdm=True, save_strategy="no", logging_steps=1,
        modules={"llm": {"parallel": "fsdp", "learning_rate": 1e-4, "fsdp_plugin": {"mixed_precision": BF16}}})
    trainer = OmniTrainer(model=model, args=args, train_dataset=data)
    trainer.remove_callback(PrinterCallback)
    trainer.train()
    measured, steps = peak() - held, trainer.state.global_step
    del trainer, model, llm
    gc_collect()
    return measured, steps


def gc_collect():
    import gc

    gc.collect()
    if CUDA:
        torch.cuda.empty_cache()


@check(60, "needs CUDA (max_memory_allocated); HF_OMNI_ACCUMULATION_TINY=1 runs its path on a tiny Llama",
       needs=() if ACCUMULATION_TINY else ("cuda",))
def accumulation_peak_memory():
    """Peak with 4 micro-steps a step / with 1, the same micro-batch: PASS if <= 1.05 (gradients stay one sharded
    fp32 copy; FSDP2 reduce-scatters every micro-step, `sync_each_batch` true)."""
    runs = {}
    for accumulation in (1, 4):
        runs[accumulation] = accumulation_run(accumulation, f"/tmp/hf_omni_gpu_check/accumulation_{accumulation}")
    ratio = runs[4][0] / runs[1][0]
    figure = (f"peak {runs[4][0] / 2**30:.2f} GiB with 4 micro-steps / {runs[1][0] / 2**30:.2f} GiB with 1 = "
              f"{ratio:.3f} (want <= {ACCUMULATION_RATIO}); micro-batch {ACCUMULATION_BATCH} x {ACCUMULATION_LENGTH}, "
              f"{runs[4][1]} and {runs[1][1]} optimizer steps, Llama {ACCUMULATION_LLAMA['hidden_size']} x "
              f"{ACCUMULATION_LLAMA['num_hidden_layers']} layers")
    if not CUDA:
        return None, f"tiny Llama on CPU (VmHWM, not device memory): {figure}"
    return ratio <= ACCUMULATION_RATIO and runs[4][1] == runs[1][1] == 2, figure


@check(60, "VmHWM (peak resident) instead of max_memory_allocated; bf16 on CPU kernels, minutes")
def fake_world_512_memory():
    """Per rank: bound = 16 x (the rank's shard elements: fp32 master, gradient, 2 AdamW moments) + 10 x U bytes
    (U: the largest FSDP2 unit's elements; in backward, bf16: that unit and the next one gathered, 2 + 2, its bf16
    gradients, 2, their fp32 reduce-scatter input, 4) + activations (4 B x tokens x layers x (24 h + 6 i)).
    PASS if the measured peak is at most 1.25 x the bound for both models."""
    if RANK != 0:
        return True, f"rank {RANK}: rank 0 measures"
    rows, ok = [], True
    for which in MODELS:
        r = run_fake_world(which)
        ratio = r["measured"] / r["bound"]
        ok = ok and ratio <= MARGIN and r["shards"] == ["torch.float32"]
        rows.append(f"{which}: {r['measured'] / 2**30:.2f} GiB / bound {r['bound'] / 2**30:.2f} = {ratio:.2f} "
                    f"(shards {r['local'] / 1e6:.1f}M of {r['params'] / 1e9:.2f}B, {'/'.join(r['shards'])}; "
                    f"state {r['state'] / 2**20:.0f} MiB, 10 x unit {r['transient'] / 2**30:.2f} GiB; "
                    f"{r['seconds']:.0f} s" + (f"; ep: {sum(r['mirrored'])} token rows to this rank's expert, counts "
                                               "mirrored)" if r["mirrored"] else ")"))
    return ok, f"rank 0 of fake {FAKE_WORLD}, peak by {r['how']}: " + "; ".join(rows) + f" (want <= {MARGIN})"


def fake_world_steps(world: int = 2, steps: int = 6) -> dict:
    """One rank of a fake world of `world`: the demo's LLM prepared by hf_omni's driver (FSDP2, bf16 compute, fp32
    masters), `steps` steps of forward, backward, hf_omni's global gradient norm (`module_grad_norm`: DTensor
    reduction over the mesh), clipping at 1.0 by it, AdamW; steps 2 and later armed with
    `set_sync_debug_mode("error")` on CUDA. Returns the steps run armed, the collectives issued (name -> bytes this
    rank would receive) and the first sync error. Not the trainer: `OmniPlugin.prepare` makes hf_omni's gloo side
    group first, which a fake world cannot (gloo meets its other ranks through the store)."""
    import types

    import torch.distributed as dist
    from torch.nn.utils import clip_grads_with_norm_

    from hf_omni import OmniPlugin
    from hf_omni.compat import init_fake_process_group
    from hf_omni.optim.gradients import module_grad_norm
    from hf_omni.parallel import driver
    from hf_omni.testing.collectives import ReceivedBytes
    from hf_omni.testing.digits import build_model
    from hf_omni.tuning.modes import apply_training_modes

    device = torch.device("cuda", 0) if CUDA else torch.device("cpu")
    if CUDA:
        torch.cuda.set_device(device)
    llm = build_model().llm.to(device)
    model = TextOnly.make().from_modules({"llm": llm})
    armed, error = 0, None
    init_fake_process_group(0, world)
    try:
        OmniPlugin(modules={"llm": {"parallel": "fsdp", "fsdp_plugin": {"mixed_precision": BF16}}}).resolve(model)
        apply_training_modes(model.slots)
        accelerator = types.SimpleNamespace(device=device, mixed_precision="bf16",
                                            prepare_model=lambda model, **kwargs: model)
        driver.prepare_modules(accelerator, model, fsdp_scope="module")
        params = [p for p in model.llm.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(params, lr=1e-3)
        ids = torch.randint(0, model.llm.config.vocab_size, (BATCH_FAKE, 16), device=device)
        with ReceivedBytes() as received:
            for step in range(steps):
                if CUDA and step:
                    torch.cuda.set_sync_debug_mode("error")
                try:
                    model(input_ids=ids, labels=ids).loss.backward()
                    clip_grads_with_norm_(params, 1.0, module_grad_norm(params, device))
                    optimizer.step()
                    optimizer.zero_grad(set_to_none=True)
                except RuntimeError as err:
                    error = f"step {step + 1}: {(str(err).splitlines() or [''])[0]}"
                    break
                finally:
                    if CUDA:
                        torch.cuda.set_sync_debug_mode(0)
                armed += bool(step)
    finally:
        dist.destroy_process_group()
    return {"armed": armed, "error": error, "world": world, "placements": str(params[0].placements),
            "collectives": {k: v for k, v in received.by_name.items() if v}}


def run_fake_world_steps() -> dict:
    return run_fake_world("steps")


if __name__ == "__main__" and "--fake-world" in sys.argv:
    which = sys.argv[sys.argv.index("--fake-world") + 1]
    print(json.dumps(fake_world_steps() if which == "steps" else fake_world(which)), flush=True)
