"""The GPU checklist: ordered checks of what only a CUDA / NCCL machine proves, one PASS / FAIL line each.

    torchrun --nproc_per_node 1 bench/gpu_check.py                # one GPU: checks 1-11 (world 1: modules wrapped)
    torchrun --nproc_per_node 2 bench/gpu_check.py                # 2 GPUs (or 2 gloo ranks on CPU): + 13-16
    torchrun --nproc_per_node 4 bench/gpu_check.py --only hsdp    # HSDP needs 4 ranks;  --list: the checks, not run

A line: status, check, seconds, its figure. `PASS` / `FAIL` on CUDA; `PASS (cpu)` / `FAIL (cpu)` when it ran on
CPU / gloo (the same code, not the CUDA proof); `NEEDS DEVICE` when it needs CUDA or more ranks (or found so by
running: torch refuses CPU offload without an accelerator), and why. A check that raises is a FAIL with the
error's first line (its traceback on stderr) and the rest still run; a check past 4x its time budget (20x on
CPU) is called hung and the script exits 1. Last line: `N passed, M failed, K need a device`; exit status 1 when
any check failed. The 1-GPU list takes under 10 minutes. Every check trains the demo (`hf_omni.testing.digits`)
a few steps, each rank its share of a global batch of 32 (a 2-rank run sees the data one process does). The
registry, the rank agreement, the watchdog and the summary are bench/checklist.py.
"""

from __future__ import annotations

import copy
import functools
import gc
import itertools
import math
import shutil
import statistics
import tempfile
import threading
import time

import torch
from checklist import CUDA, RANK, WORLD, check, gloo, main  # bench/checklist.py: the registry and the runner
from transformers import PrinterCallback, TrainerCallback, default_data_collator

from hf_omni import OmniModel, OmniTrainer, OmniTrainingArguments, offline_encoder
from hf_omni.shards.box import local_of as local
from hf_omni.testing.digits import Captioner, build_model, load_splits

ROOT, STEPS, BATCH, TOLERANCE = "/tmp/hf_omni_gpu_check", 12, 32, 0.03
FSDP_BF16 = {  # the LLM sharded, bf16 compute, fp32 reductions; master_dtype auto: fp32 shards
    "vision": {"trainable": False},
    "projector": {"learning_rate": 3e-3},
    "llm": {"parallel": "fsdp", "learning_rate": 1e-3,
            "fsdp_plugin": {"mixed_precision": {"param_dtype": "bfloat16", "reduce_dtype": "float32"}}},
}
FP32 = {"vision": {"trainable": False}, "projector": {"parallel": "ddp", "learning_rate": 3e-3},
        "llm": {"parallel": "fsdp", "learning_rate": 1e-3}}


# -- the demo, trained -----------------------------------------------------------------------------------------
@functools.cache
def train_set():
    return load_splits(build_model().processors["llm"])[0]


def trainer_for(model, modules: dict, steps: int, name: str, callbacks=(), run=True, resume=None, **extra):
    """An OmniTrainer over the demo data (trained unless `run=False`); `extra`: OmniTrainingArguments fields."""
    settings = {"output_dir": f"{ROOT}/{name}", "save_strategy": "no", "logging_steps": 1, **extra}
    collator = settings.pop("data_collator", None)
    args = OmniTrainingArguments(
        max_steps=steps, per_device_train_batch_size=BATCH // WORLD, lr_scheduler_type="constant",
        optim="adamw_torch", train_sampling_strategy="sequential", use_cpu=not CUDA, report_to="none",
        disable_tqdm=True, modules=modules, **settings)
    trainer = OmniTrainer(model=model, args=args, train_dataset=train_set(), callbacks=list(callbacks),
                          **({"data_collator": collator} if collator else {}))
    trainer.remove_callback(PrinterCallback)  # the check's line is the output
    if run:
        trainer.train(resume_from_checkpoint=resume)
    return trainer


def logged(trainer, key: str) -> list[float]:
    return [entry[key] for entry in trainer.state.log_history if key in entry]


def trained_tensors(model) -> dict[str, torch.Tensor]:
    return {f"{name}.{key}": local(p).detach().clone() for name, module in model.omni_modules().items()
            for key, p in module.named_parameters() if p.requires_grad}


def reference_losses(model) -> list[float]:
    """fp32 on the CPU, one process: AdamW per trainable module, the same constant rates, clipping at 1.0."""
    model = model.cpu().float()
    model.vision.requires_grad_(False)
    model.vision.eval()
    optimizers = {n: torch.optim.AdamW(getattr(model, n).parameters(), lr=FSDP_BF16[n]["learning_rate"])
                  for n in ("projector", "llm")}
    losses = []
    for step in range(STEPS):
        items = [train_set()[i] for i in range(step * BATCH, (step + 1) * BATCH)]
        loss = model(**{k: torch.stack([it[k] for it in items]) for k in items[0]}).loss
        loss.backward()
        for name, opt in optimizers.items():
            torch.nn.utils.clip_grad_norm_(getattr(model, name).parameters(), 1.0)
            opt.step()
            opt.zero_grad()
        losses.append(loss.item())
    return losses


class MaybeImages(Captioner):
    """The demo's forward for batches without images: the entry point runs on every rank (0 rows where the batch
    has none: hf_omni's missing-modality exchange), and so does the projector, whose 0 rows join the loss."""

    def forward(self, input_ids, pixel_values=None, image_features=None, labels=None, **kw):
        prefix = self.projector(self.encode_image(pixel_values))
        embeds = self.llm.get_input_embeddings()(input_ids)
        if len(prefix):
            embeds = torch.cat([prefix, embeds], dim=1)
            labels = torch.cat([labels.new_full(prefix.shape[:2], -100), labels], dim=1)
        out = self.llm(inputs_embeds=embeds, labels=labels, **kw)
        out.loss = out.loss + prefix.sum()  # 0 where there are no images: the projector still reduces there
        return out


def images_missing_on_rank_1():
    """A collator dropping `pixel_values` from every other batch of rank 1 (at 2 ranks and more)."""
    calls = itertools.count()

    def collate(items):
        batch = default_data_collator(items)
        if WORLD > 1 and RANK == 1 and next(calls) % 2:
            batch.pop("pixel_values")
        return batch
    return collate


def demo_folder() -> str:
    """The demo's files (for `empty_init`): under a process group rank 0 writes them and every rank waits."""
    import torch.distributed as dist

    folder = f"{ROOT}/demo_model" if dist.is_initialized() else tempfile.mkdtemp(prefix="hf_omni_gpu_check_")
    build_model().save_pretrained(folder)  # under a process group: written by rank 0 only
    if dist.is_initialized():
        dist.barrier(group=gloo())
    return folder


# -- the checks, in order --------------------------------------------------------------------------------------
@check(40, "the same code under gloo; bf16 compute on CPU kernels")
def fsdp_bf16_masters():
    model = build_model()
    reference = reference_losses(copy.deepcopy(model))
    losses = logged(trainer_for(model, FSDP_BF16, STEPS, "fsdp_bf16"), "loss")
    worst = max(abs(got - ref) / abs(ref) for got, ref in zip(losses, reference))
    return (len(losses) == STEPS and worst <= TOLERANCE,
            f"max relative loss difference {worst:.4f} vs the fp32 CPU loop, {len(losses)} steps (tol {TOLERANCE})")


@check(20, "the same code under gloo; bf16 compute on CPU kernels")
def dtypes():
    seen, model = {"shard": set(), "grad": set()}, build_model()
    model.llm.model.layers[0].self_attn.q_proj.register_forward_hook(  # a Linear's output: the gathered dtype
        lambda module, inputs, out: seen.setdefault("compute", {out.dtype}) and None)

    class Grads(TrainerCallback):  # the gradients exist between clipping and the optimizer step
        def on_pre_optimizer_step(self, args, st, control, model=None, **kw):
            for p in model.llm.parameters():
                seen["shard"].add(local(p).dtype)
                seen["grad"].add(local(p.grad).dtype if p.grad is not None else None)
            seen["dtensor"] = hasattr(next(model.llm.parameters()), "to_local")

    trainer = trainer_for(model, FSDP_BF16, 1, "dtypes", [Grads()])
    exp_avg = {local(s["exp_avg"]).dtype for s in trainer.plugin.optimizer.optimizers["llm"].state.values()}
    ok = seen["shard"] == seen["grad"] == exp_avg == {torch.float32} and seen.get("compute") == {torch.bfloat16}
    name = lambda dtypes: "/".join(sorted(str(d).replace("torch.", "") for d in dtypes))  # noqa: E731
    return ok and seen["dtensor"], (
        f"llm shard {name(seen['shard'])} ({'DTensor' if seen['dtensor'] else 'NOT sharded'}), grad "
        f"{name(seen['grad'])}, exp_avg {name(exp_avg)}, compute {name(seen.get('compute', {None}))} "
        f"(want fp32 x3, bf16)")


@check(45, "needs CUDA (set_sync_debug_mode)", needs=("cuda",))
def sync_free_steps():
    state = {"clean": 0}

    class Arm(TrainerCallback):  # armed in steps 2-6, off at each step's end (before Trainer logs or saves)
        def on_step_begin(self, args, st, control, **kw):
            if st.global_step >= 1:
                torch.cuda.set_sync_debug_mode("error")
                state["armed"] = True

        def on_step_end(self, args, st, control, **kw):
            torch.cuda.set_sync_debug_mode(0)
            state["clean"] += state.pop("armed", False)

    demo = build_model()
    model = MaybeImages.from_modules(demo.omni_modules(), processors=demo.processors)
    try:
        trainer_for(model, FSDP_BF16, 6, "sync", [Arm()], logging_steps=1000, logging_nan_inf_filter=False,
                    grad_clip_scope="global", data_collator=images_missing_on_rank_1())
    except RuntimeError as err:
        return False, f"a sync in armed step {state['clean'] + 1}: {str(err).splitlines()[0]}"
    finally:
        torch.cuda.set_sync_debug_mode(0)
    where = "rank 1 without images every other step" if WORLD > 1 else "1 rank: every batch has images"
    figure = f"{state['clean']} of 5 steps without a host sync (global clipping; {where})"
    if WORLD > 1:
        return state["clean"] == 5, figure
    from gpu_scale_checks import run_fake_world_steps  # one rank: FSDP2 at 2 ranks too, in a fake world

    fake = run_fake_world_steps()
    issued = all(any(n.startswith(kind) for n in fake["collectives"]) for kind in ("all_gather", "reduce_scatter"))
    return state["clean"] == 5 and fake["armed"] == 5 and issued, figure + (
        f"; fake world of 2 (LLM alone, FSDP2 {fake['placements']}, hf_omni's global norm, clipping, AdamW): "
        f"{fake['armed']} of 5 armed steps without a host sync{' (' + fake['error'] + ')' if fake['error'] else ''}, "
        f"collectives {sorted(fake['collectives'])}")


@check(60, "the same code under gloo; no copy stream on CPU")
def async_save_resume():
    ends = []

    class Tick(TrainerCallback):  # each step's end, the training stream drained (not the copy stream)
        def on_step_end(self, *args, **kw):
            if CUDA:
                torch.cuda.current_stream().synchronize()
            ends.append(time.perf_counter())

    straight = trainer_for(build_model(), FSDP_BF16, 8, "async", [Tick()], save_strategy="steps", save_steps=4,
                           save_async=True)
    stream = getattr(getattr(getattr(straight.plugin.checkpointer, "async_save", None), "stream", None), "stream", None)
    if CUDA:
        ok_stream = stream is not None and stream != torch.cuda.default_stream()
        named = f"copy stream {stream!r}: " + ("not the default stream" if ok_stream else "NOT a stream of its own")
    else:
        ok_stream, named = stream is None, "no copy stream (CPU)"
    resumed = trainer_for(build_model(), FSDP_BF16, 8, "async_resumed", resume=f"{ROOT}/async/checkpoint-4")
    want, got = trained_tensors(straight.model), trained_tensors(resumed.model)
    equal = sum(torch.equal(want[k], got[k]) for k in want if k in got)
    step = {k: ends[k - 1] - ends[k - 2] for k in (3, 4, 5, 6)}  # step k: from step k-1's end to its own
    times = ", ".join(f"{k}: {v * 1000:.0f}" for k, v in step.items())
    ratio = step[5] / statistics.median([step[3], step[4], step[6]])
    return (equal == len(want) == len(got) and ok_stream,
            f"resume from checkpoint-4 to 8: {equal}/{len(want)} tensors bitwise equal; step ms {times} (saved "
            f"after 4: step 5 / median of 3, 4, 6 = {ratio:.2f}); {named}")


@check(45, "needs CUDA while torch's CPU offload pins memory (refused without an accelerator)")
def offload_clipping():
    offload = copy.deepcopy(FP32)
    offload["llm"]["fsdp_plugin"] = {"cpu_offload": True}
    folder, runs, problems = demo_folder(), {}, []
    try:
        for label, modules in (("offload", offload), ("offload + empty_init", offload), ("no offload", FP32)):
            model = Captioner.from_pretrained(folder, empty_init=True) if "empty" in label else build_model()
            placed = {}

            class Where(TrainerCallback):  # after prepare: where the LLM's shards and buffers are
                def on_train_begin(self, args, st, control, model=None, **kw):
                    placed["shards"] = {local(p).device.type for p in model.llm.parameters()}
                    placed["away"] = [f"{n} on {b.device}" for n, b in model.llm.named_buffers()
                                      if b.device.type != args.device.type]
            try:
                trainer = trainer_for(model, modules, 3, f"offload_{len(runs)}", [Where()],
                                      grad_clip_scope="global", max_grad_norm=0.5)
            except RuntimeError as err:
                if CUDA or "accelerator" not in str(err):
                    raise
                return None, (f"cpu_offload refused on CPU by torch ({str(err).splitlines()[0]} FSDP2's "
                              "CPUOffloadPolicy pins host memory by default)")
            runs[label] = sum((logged(trainer, k) for k in ("grad_norm", "grad_norm/llm", "grad_norm/projector")), [])
            problems += [f"{label}: buffer {where}" for where in placed["away"]]
            if label != "no offload" and CUDA and placed["shards"] != {"cpu"}:
                problems.append(f"{label}: llm shards on {placed['shards']}, not offloaded")
    finally:
        if not folder.startswith(ROOT):  # a temporary copy (ROOT is cleared at the next start)
            shutil.rmtree(folder, ignore_errors=True)
    worst = 0.0
    for label, norms in runs.items():
        if len(norms) != 9 or not all(map(math.isfinite, norms)):
            problems.append(f"{label}: grad norms {norms}")
        worst = max([worst] + [abs(a - b) / max(abs(b), 1e-12) for a, b in zip(norms, runs["no offload"])])
    figure = (f"global clipping at 0.5, 3 steps: grad norms (total, llm, projector) finite, max rel. diff vs no "
              f"offload {worst:.1e} (normal build and empty_init; tol 1e-4); llm shards on cpu, buffers on "
              f"{'cuda' if CUDA else 'cpu'}")
    return not problems and worst <= 1e-4, (figure if not problems else "; ".join(problems))


def offload_refused(err: RuntimeError):
    """On CPU, torch may refuse an offloaded module (pinned memory needs an accelerator): NEEDS DEVICE."""
    if CUDA or "accelerator" not in str(err):
        raise err
    return None, f"cpu_offload refused on CPU by torch ({str(err).splitlines()[0]})"


@check(40, "the same code under gloo; on CPU the group's device is the CPU, where the shards are")
def offload_merged_lora_export():
    """An offloaded LLM with LoRA (CPU shards, NCCL group on cuda): `save_pretrained(merge_lora=True)` gathers
    lora_A whole on every rank (`full_tensor`) on the group's device; the export equals PEFT's own merge."""
    from transformers import AutoModelForCausalLM

    from hf_omni.lora.adapters import merged_module

    modules = copy.deepcopy(FP32)
    modules["llm"].update(fsdp_plugin={"cpu_offload": True}, lora={"r": 4, "lora_alpha": 8,
                                                                   "target_modules": ["q_proj", "v_proj"]})
    try:
        trainer = trainer_for(build_model(), modules, 2, "offload_lora")
    except RuntimeError as err:
        return offload_refused(err)
    model, folder = trainer.model, f"{ROOT}/offload_lora/export"
    shards = {local(p).device.type for p in model.llm.parameters()}
    model.save_pretrained(folder, merge_lora=True)  # every rank: its rows, lora_A gathered on the group's device
    state = model.slots["llm"].full_state()  # every rank joins
    if RANK != 0:
        return True, f"rank {RANK}: exported (rank 0 compares)"
    expected = merged_module(model.llm, state).state_dict()
    written = AutoModelForCausalLM.from_pretrained(f"{folder}/llm").state_dict()
    worst = max((written[k].float() - expected[k].float().cpu()).abs().max().item() for k in written)
    ok = sorted(written) == sorted(expected) and worst <= 1e-6 and (shards == {"cpu"} or not CUDA)
    return ok, (f"merged export of the offloaded llm (shards on {'/'.join(sorted(shards))}) vs PEFT's merge: "
                f"{len(written)} tensors, keys {'equal' if sorted(written) == sorted(expected) else 'DIFFER'}, "
                f"max abs diff {worst:.1e} (tol 1e-6)")


@check(40, "the same code under gloo; on CPU the group's device is the CPU, where the shards are")
def offload_fused_moe_save():
    """An offloaded Mixtral (experts fused in memory, one file tensor per expert): each derived group is gathered
    (`dist.gather`) on its writer on the group's device; the saved folder loads back bitwise."""
    from accelerate import Accelerator
    from transformers import MixtralConfig, MixtralForCausalLM

    from hf_omni import OmniPlugin

    torch.manual_seed(0)
    config = MixtralConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2)
    llm = MixtralForCausalLM(config)
    reference = {k: v.detach().clone() for k, v in llm.state_dict().items()}
    plugin = OmniPlugin(modules={"llm": {"parallel": "fsdp", "fsdp_plugin": {"cpu_offload": True}}},
                        defaults={"learning_rate": 1e-3}, output_dir=f"{ROOT}/offload_moe")
    try:
        model, _, _ = plugin.prepare(Accelerator(cpu=not CUDA), OmniModel.from_modules({"llm": llm}), 2)
    except RuntimeError as err:
        plugin.close()
        return offload_refused(err)
    try:
        shards = {local(p).device.type for p in model.llm.parameters()}
        folder = f"{ROOT}/offload_moe/export"
        model.save_pretrained(folder)  # every rank: its rows; the experts' groups gathered on their writers
        if RANK != 0:
            return True, f"rank {RANK}: saved (rank 0 compares)"
        loaded = MixtralForCausalLM.from_pretrained(f"{folder}/llm").state_dict()
        equal = sorted(loaded) == sorted(reference) and all(torch.equal(loaded[k], reference[k]) for k in loaded)
        experts = sum(".experts." in k for k in loaded)
        return equal and experts > 0 and (shards == {"cpu"} or not CUDA), (
            f"offloaded Mixtral (shards on {'/'.join(sorted(shards))}) saved and loaded back: {len(loaded)} "
            f"tensors ({experts} fused expert tensors), {'bitwise equal' if equal else 'DIFFERENT'}")
    finally:
        plugin.close()


@check(30, "the per-module table only (the peak needs CUDA)")
def memory_vs_profile():
    gc.collect()
    if CUDA:
        torch.cuda.empty_cache()
        held = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    trainer = trainer_for(build_model(), FSDP_BF16, 3 if CUDA else 1, "memory")
    if not hasattr(trainer.plugin, "module_bytes"):
        return False, "OmniPlugin.module_bytes() is missing (the per-module bytes table): nothing to compare"
    table, kinds = trainer.plugin.module_bytes(), ("parameters", "gradients", "optimizer", "master")
    sums = {name: sum(int(row.get(k, 0)) for k in kinds) for name, row in table.items()}
    total, rows = sum(sums.values()), ", ".join(f"{n} {b / 2**20:.2f}" for n, b in sums.items())
    well_formed = bool(table) and all(set(kinds) <= set(row) for row in table.values())
    if not CUDA:
        return well_formed, f"table MiB per rank: {rows}; total {total / 2**20:.2f} (cpu: no peak to compare)"
    peak = torch.cuda.max_memory_allocated() - held
    return (well_formed and total <= peak,
            f"peak {peak / 2**20:.1f} MiB (above what was held before) / table {total / 2**20:.1f} MiB = "
            f"{peak / max(total, 1):.2f} (want >= 1, about < 3 with activations); table MiB: {rows}")


import gpu_scale_checks  # noqa: F401 - registers accumulation_peak_memory, fake_world_512_memory here


@check(30, "needs CUDA (fp16 is refused on CPU)", needs=("cuda",))
def fp16_injected_inf():
    modules = {"vision": {"trainable": False}, "projector": {"learning_rate": 3e-3},
               "llm": {"parallel": "ddp", "learning_rate": 1e-3}}
    box, seen = {}, {}

    def now():  # every trained tensor, the scale, each module's scheduler position
        return (trained_tensors(trainer.model), trainer.accelerator.scaler.get_scale(),
                {n: s.last_epoch for n, s in trainer.plugin.scheduler.schedulers.items()})

    class Inject(TrainerCallback):
        def on_train_begin(self, args, st, control, model=None, **kw):
            trainer.accelerator.scaler._init_scale = 2.0 ** 10  # read lazily: no natural overflow at step 2
            if RANK == WORLD - 1:  # one rank, one projector gradient; hooked after wrapping
                next(model.projector.parameters()).register_hook(
                    lambda g: g * float("inf") if box.get("step") == 3 else g)

        def on_step_begin(self, args, st, control, **kw):
            box["step"] = st.global_step + 1
            box["before"] = now()

        def on_step_end(self, args, st, control, **kw):
            (tensors, scale, epochs), (after, scale_after, epochs_after) = box["before"], now()
            seen[box["step"]] = (sum(not torch.equal(tensors[k], after[k]) for k in after), len(after), scale,
                                 scale_after, epochs, epochs_after)

    trainer = trainer_for(build_model(), modules, 4, "fp16", [Inject()], run=False, fp16=True)
    trainer.train()
    (changed2, n, _, _, e2, e2_after), (changed3, _, s3, s3_after, e3, e3_after) = seen[2], seen[3]
    ok = (changed2 > 0 and all(e2_after[k] == e2[k] + 1 for k in e2)  # the control step stepped
          and changed3 == 0 and s3_after == s3 / 2 and e3_after == e3)
    return ok, (f"step 3 (inf in one projector gradient): {changed3}/{n} tensors changed, scale {s3:g} -> "
                f"{s3_after:g}, schedulers' last_epoch {e3} -> {e3_after}; control step 2: {changed2}/{n} "
                f"changed, last_epoch {e2} -> {e2_after}")


@check(40, "4 gloo ranks, launched with --nproc_per_node 4", needs=("4 ranks",))
def hsdp():
    hybrid = copy.deepcopy(FP32)  # 2 x 1 is refused (replicas without sharding are `parallel: ddp`)
    hybrid["llm"]["parallelism"] = {"dp_replicate_size": 2, "dp_shard_size": WORLD // 2}
    full = logged(trainer_for(build_model(), FP32, 4, "full_shard"), "loss")
    hybrid_losses = logged(trainer_for(build_model(), hybrid, 4, "hsdp"), "loss")
    worst = max(abs(a - b) / abs(b) for a, b in zip(hybrid_losses, full))
    return (len(full) == len(hybrid_losses) == 4 and worst <= 1e-5,
            f"llm HSDP 2 x {WORLD // 2} vs full shard over {WORLD}: max relative loss difference {worst:.1e}, "
            f"4 steps (tol 1e-5)")


@check(40, "2 gloo ranks (sdpa's CPU kernel)", needs=("2 ranks",))
def sequence_parallel():
    """The LLM at sp 2 (Ulysses: NCCL all-to-alls, sdpa's CUDA kernels over the whole sequence for half the heads)
    against full shard over the same ranks."""
    split = copy.deepcopy(FP32)
    split["llm"]["parallelism"] = {"dp_shard_size": WORLD // 2, "sp_size": 2}
    full = logged(trainer_for(build_model(), FP32, 4, "full_shard_sp"), "loss")
    split_losses = logged(trainer_for(build_model(), split, 4, "sp"), "loss")
    worst = max(abs(a - b) / abs(b) for a, b in zip(split_losses, full))
    return (len(full) == len(split_losses) == 4 and worst <= 1e-5,
            f"llm sp 2 x dp_shard {WORLD // 2} vs full shard over {WORLD}: max relative loss difference {worst:.1e}, "
            f"4 steps (tol 1e-5)")


@check(30, "2 gloo ranks (diffusers' native attention on the CPU)", needs=("2 ranks",))
def diffusers_sequence_parallel():
    """A Wan video transformer (4 heads, 320 tokens) at `{dp_shard_size: world / 2, sp_size: 2}`: diffusers' own
    Ulysses attention over NCCL, its native backend's CUDA kernels, each rank its own row; against the same model on
    every rank's row in this process: outputs, and every weight's gradient (FSDP2's average over the ranks)."""
    import torch.distributed as dist
    from diffusers import WanTransformer3DModel
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from hf_omni.compat import flatten_mesh
    from hf_omni.parallel.sequence import SequenceLayout

    if not dist.is_initialized():
        trainer_for(build_model(), FP32, 1, "groups")
    device = torch.device("cuda", torch.cuda.current_device()) if CUDA else torch.device("cpu")
    torch.manual_seed(0)
    model = WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=4, attention_head_dim=16, in_channels=16,
                                  out_channels=16, text_dim=32, freq_dim=256, ffn_dim=64, num_layers=2,
                                  cross_attn_norm=True, qk_norm="rms_norm_across_heads", rope_max_seq_len=32).to(device)
    reference = copy.deepcopy(model)
    sizes = {"dp_shard_size": WORLD // 2, "sp_size": 2}
    mesh = init_device_mesh(device.type, (WORLD // 2, 2), mesh_dim_names=("dp_shard", "sp"))
    layout = SequenceLayout("transformer", sizes)
    layout.check(model)
    layout.apply(model, mesh)
    fully_shard(model, mesh=mesh[flatten_mesh(mesh, ("dp_shard", "sp"))])
    layout.after_fsdp(model, mesh, ())

    def row(rank: int):  # 5 latent frames of 16 x 16: 5 x 8 x 8 = 320 tokens
        g = torch.Generator().manual_seed(rank)
        return [v.to(device) for v in (torch.randn(1, 16, 5, 16, 16, generator=g), torch.rand(1, generator=g) * 1000,
                                       torch.randn(1, 16, 32, generator=g))]

    x, t, e = row(RANK)
    out = model(hidden_states=x, timestep=t, encoder_hidden_states=e, return_dict=False)[0]
    out.square().mean().backward()
    outs = [reference(hidden_states=a, timestep=b, encoder_hidden_states=c, return_dict=False)[0]
            for a, b, c in map(row, range(WORLD))]
    (sum(o.square().mean() for o in outs) / WORLD).backward()
    ref = dict(reference.named_parameters())
    scale = max(p.grad.abs().max().item() for p in reference.parameters())
    worst_grad = max((p.grad.full_tensor() - ref[n].grad).abs().max().item() for n, p in model.named_parameters())
    worst_out = (out - outs[RANK]).abs().max().item() / outs[RANK].abs().max().item()
    return (worst_out <= 1e-4 and worst_grad <= 1e-4 * scale,
            f"Wan transformer sp 2 x dp_shard {WORLD // 2}: output within {worst_out:.1e} (relative), gradients within "
            f"{worst_grad / scale:.1e} of the largest (tol 1e-4 each)")


@check(20, "2 gloo ranks: the group count only (no device memory)", needs=("2 ranks",))
def nccl_memory_per_communicator():
    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    if not dist.is_initialized():
        trainer_for(build_model(), FP32, 1, "groups")
    existing = len(distributed_c10d._world.pg_map)
    if CUDA:
        torch.cuda.synchronize()
        free, reserved = torch.cuda.mem_get_info()[0], torch.cuda.memory_reserved()
    for group in [dist.new_group(list(range(WORLD))) for _ in range(2)]:  # made at its first collective
        dist.all_reduce(torch.ones(1, device="cuda" if CUDA else "cpu"), group=group)
    if not CUDA:
        return True, f"{existing} process groups in this process before; 2 more made (cpu: no device memory)"
    torch.cuda.synchronize()
    used, in_torch = (free - torch.cuda.mem_get_info()[0]) / 2**21, (torch.cuda.memory_reserved() - reserved) / 2**21
    return True, (f"per NCCL communicator over {WORLD} ranks: {used:.1f} MiB of device memory ({in_torch:.1f} MiB "
                  f"of it in torch's allocator); {existing} process groups in this process before")


class MaskedTower(OmniModel):
    """An entry point with two inputs, pixels and their mask (as tests/scripts/mp_exchange.py)."""

    @offline_encoder(module="vision", inputs=["pixel_values", "mask"], output="features")
    def encode(self, pixel_values, mask):
        return self.vision(pixel_values=pixel_values * mask).last_hidden_state

    def forward(self, pixel_values=None, mask=None):
        return {"loss": self.encode(pixel_values, mask=mask).square().mean()}


@check(20, "2 gloo ranks, launched with --nproc_per_node 2", needs=("2 ranks",))
def nccl_missing_modality_one_rank_raises():  # last: it leaves the training group mid-step
    from accelerate import Accelerator

    from hf_omni import OmniPlugin

    plugin, accelerator = OmniPlugin(modules={"vision": {"parallel": "ddp"}}), Accelerator(cpu=not CUDA)
    model, _, _ = plugin.prepare(accelerator, MaskedTower.from_modules({"vision": build_model().vision}), 2)
    pixels, mask = torch.rand(2, 1, 8, 8), torch.ones(2, 1, 1, 1)
    start = time.perf_counter()
    try:
        model(pixel_values=pixels.to(accelerator.device),
              mask=None if RANK == 1 else mask.to(accelerator.device))["loss"].backward()
        return False, f"rank {RANK}: no error (rank 1 passed pixel_values without their mask)"
    except ValueError as err:
        seconds, message = time.perf_counter() - start, str(err).splitlines()[0]
        return "vision" in message and seconds < 30, f"rank {RANK} raised ValueError in {seconds:.1f} s: {message}"
    finally:
        plugin.close()


if __name__ == "__main__":
    main(__doc__, ROOT)
