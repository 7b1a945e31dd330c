"""The training step at 2 ranks (`accelerate launch --multi_gpu --num_processes 2`, gloo), one launch:

- `online`, `offline`: OmniTrainer over the LLaVA-style captioner whose ranks lack an image at some steps
  (`LAYOUT`), vision trained sharded or served from its offline cache, global clipping. From the end of step 1 to
  the end of training every host read of device memory made by hf_omni's own frames is recorded
  (`hf_omni.testing.host_reads`); the test wants none.
- `offload`: the LLM sharded with `cpu_offload` (built, and with `empty_init`) beside a replicated projector, global
  clipping: the same losses, norms and weights as with the LLM resident; shards on the CPU, buffers where compute
  runs.
- `grouped`: `group_by_modality: true` under a forward that skips the vision tower when its batch has no image (as
  a released model's own forward does; no entry point called), vision sharded: every step's batches have images
  on every rank or on none, and the run ends.
- `windows`: a loop over OmniPlugin agreeing an accumulation window's exchange with `plugin.agree_window`, then
  `generate` of the same model (`GenerationMixin`): hf_omni's side-group collectives of each.
- `fp16`: a loop over OmniPlugin under fp16 compute with torch's CPU GradScaler (the FSDP LLM gathered in fp16, its
  gradients reduced in fp32 into fp32 shards); at step 2 an inf is put into one gradient of the
  replicated projector on rank 1 alone (after DDP's reduction, so no collective carries it): every module on every
  rank must skip, the scale back off alike, no scheduler step. The same counter must see fp16's one host read per
  step (hf_omni.optim.optimizers): the positive control of the counter.

Usage: mp_step.py OUT_DIR -> OUT_DIR/<scenario>-rank<r>.json"""

import contextlib
import json
import os
import sys

import helpers
import mixed_modality
from collective_dtypes import CollectiveDtypes
import torch
import torch.distributed as dist
from accelerate import Accelerator
from transformers import GenerationMixin, TrainerCallback

import hf_omni.offline.dummy as missing_modality
from hf_omni import OmniPlugin, OmniTrainer
from hf_omni.core.dist import checkpoint_group
from hf_omni.testing.collectives import ReceivedBytes
from hf_omni.testing.host_reads import HostReads
from launching import end_distributed

# 2 ranks x 2 samples (rank r of step k: samples 4k + 2r, 4k + 2r + 1): which ranks have an image at each step
LAYOUT = [[True, True], [True, False], [False, True], [False, False], [True, True], [False, True]]
HAS_IMAGE = [image for step in LAYOUT for image in step for _ in range(2)]
MODULES = {"vision": {"parallel": "fsdp", "learning_rate": 1e-3}, "projector": {"parallel": "ddp", "learning_rate": 3e-3},
           "llm": {"parallel": "fsdp", "learning_rate": 1e-3}}
OFFLINE = dict(MODULES, vision={"trainable": False})
RESIDENT = {"vision": {"trainable": False}, "projector": {"parallel": "ddp", "learning_rate": 3e-3},
            "llm": {"parallel": "fsdp", "learning_rate": 1e-3}}
OFFLOADED = dict(RESIDENT, llm={**RESIDENT["llm"], "fsdp_plugin": {"cpu_offload": True}})


class CountHostReads(TrainerCallback):
    """Armed from the end of step 1 (lazy initialisation done) to the end of training; logging runs inside but is
    excluded by frame (`host_reads.EXCLUDED`)."""

    def __init__(self):
        self.mode = HostReads()

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == 1:
            self.mode.__enter__()

    def on_train_end(self, args, state, control, **kwargs):
        self.mode.__exit__(None, None, None)


def dummies_run() -> list:
    calls = []
    original = missing_modality.dummy_rows

    def counted(model, spec, fn, bound):
        calls.append(spec.module)
        return original(model, spec, fn, bound)

    missing_modality.dummy_rows = counted
    return calls


def train(out_dir: str, name: str, modules: dict, **extra) -> dict:
    model = mixed_modality.mixed_model()
    args = helpers.make_args(os.path.join(out_dir, name), modules=modules, per_device_train_batch_size=2,
                             max_steps=len(LAYOUT), logging_steps=3, grad_clip_scope="global", max_grad_norm=0.05,
                             **extra)
    counter = CountHostReads()
    trainer = OmniTrainer(model=model, args=args, train_dataset=mixed_modality.MixedCaptions(model, HAS_IMAGE),
                          data_collator=mixed_modality.collate, callbacks=[counter])
    trainer.train()
    return {"host_reads": counter.mode.found, "other_reads": counter.mode.others, "steps": trainer.state.global_step,
            "losses": helpers.step_losses(trainer)}


class SkippingCaptioner(mixed_modality.MixedCaptioner):
    """Runs vision and projector only when its batch has an image, as a released model's forward does."""

    seen: list = []

    def forward(self, input_ids, pixel_values=None, labels=None, **kw):
        embeds = self.llm.get_input_embeddings()(input_ids)
        if self.training:
            self.seen.append(pixel_values is not None)
        if pixel_values is not None:
            slots = (input_ids == self.processors["llm"].unk_token_id).unsqueeze(-1)
            feats = self.projector(self.vision(pixel_values=pixel_values).last_hidden_state)
            embeds = embeds.masked_scatter(slots, feats.to(embeds.dtype))
        return self.llm(inputs_embeds=embeds, labels=labels, **kw)


def grouped(out_dir: str) -> dict:
    model = mixed_modality.mixed_model(SkippingCaptioner)
    args = helpers.make_args(os.path.join(out_dir, "grouped"), modules=MODULES, per_device_train_batch_size=2,
                             max_steps=8, group_by_modality=True, train_sampling_strategy="random")
    has_image = [i % 3 != 1 for i in range(24)]  # mixed within what sequential 2 x 2 batches would give
    trainer = OmniTrainer(model=model, args=args, train_dataset=mixed_modality.MixedCaptions(model, has_image),
                          data_collator=mixed_modality.collate)
    trainer.train()
    return {"seen": model.seen, "steps": trainer.state.global_step, "resume": grouped_resume(out_dir)}


def grouped_resume(out_dir: str) -> dict:
    """Resumed mid-epoch 1 (6 steps an epoch): the rest of epoch 1 in epoch 1's order, so the straight run's
    losses (Trainer's skipping sampler does not pass the epoch on)."""
    def run(name: str, resume: str | None = None) -> dict:
        model = mixed_modality.mixed_model()
        args = helpers.make_args(os.path.join(out_dir, name), modules=MODULES, per_device_train_batch_size=2,
                                 max_steps=9, group_by_modality=True, train_sampling_strategy="random",
                                 save_strategy="steps", save_steps=7)
        trainer = OmniTrainer(model=model, args=args, train_dataset=mixed_modality.MixedCaptions(
            model, [i % 3 != 1 for i in range(24)]), data_collator=mixed_modality.collate)
        trainer.train(resume_from_checkpoint=resume)
        return {e["step"]: e["loss"] for e in trainer.state.log_history if "loss" in e and e["step"] > 7}

    straight = run("grouped_straight")
    return {"straight": straight, "resumed": run("grouped_resumed", os.path.join(out_dir, "grouped_straight",
                                                                             "checkpoint-7"))}


def offload(out_dir: str) -> dict:
    os.environ["HF_OMNI_TEST_SAVED"] = os.path.join(out_dir, "saved")  # empty_init_model: one folder for all ranks
    runs, facts = {}, {}
    for name, build, modules in (("resident", helpers.tiny_model, RESIDENT), ("offloaded", helpers.tiny_model, OFFLOADED),
                                 ("offloaded_empty_init", helpers.empty_init_model, OFFLOADED)):
        model = build()
        args = helpers.make_args(os.path.join(out_dir, name), modules=modules, per_device_train_batch_size=4,
                                 max_steps=3, grad_clip_scope="global", max_grad_norm=0.05)
        trainer = OmniTrainer(model=model, args=args, train_dataset=helpers.tiny_data(model))
        trainer.train()
        norms = [[e["grad_norm"], e["grad_norm/llm"], e["grad_norm/projector"]] for e in trainer.state.log_history
                 if "grad_norm" in e]
        runs[name] = (helpers.step_losses(trainer), norms, helpers.full_state(model))
        facts[name] = {"shards": sorted({p.to_local().device.type for p in model.llm.parameters()}),
                       "buffers": sorted({b.device.type for b in model.llm.buffers()}),
                       "compute": trainer.args.device.type, "norms": norms}
    losses, norms, state = runs["resident"]
    for name in ("offloaded", "offloaded_empty_init"):
        other = runs[name]
        facts[name]["loss_diff"] = max(abs(a - b) for a, b in zip(losses, other[0]))
        facts[name]["norm_diff"] = max(abs(a - b) for x, y in zip(norms, other[1]) for a, b in zip(x, y))
        facts[name]["weight_diff"] = max((state[k] - other[2][k]).abs().max().item() for k in state
                                         if state[k].is_floating_point())
    return facts


def fp16(out_dir: str) -> dict:
    model = helpers.tiny_model()
    plugin = OmniPlugin(modules={"vision": {"trainable": False}, "projector": {"parallel": "ddp"},
                                 "llm": {"parallel": "fsdp"}}, defaults={"learning_rate": 1e-3})
    accelerator = Accelerator(cpu=True, mixed_precision="fp16")  # fp16 compute: the LLM gathered in fp16
    accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    model, optimizer, scheduler = plugin.prepare(accelerator, model, num_training_steps=4)
    data = helpers.tiny_data(model, 16)
    rank = dist.get_rank()
    facts = []
    with HostReads() as reads, CollectiveDtypes() as collectives:
        for step in range(3):
            batch = {k: torch.stack([data[4 * step + 2 * rank + i][k] for i in range(2)]) for k in data[0]}
            before = {n: p.detach().to_local().clone() if hasattr(p, "to_local") else p.detach().clone()
                      for n, p in model.named_parameters() if p.requires_grad}
            epochs = {n: s.last_epoch for n, s in scheduler.schedulers.items()}
            accelerator.scaler.scale(model(**batch).loss).backward()
            grad = str(model.llm.model.layers[0].self_attn.q_proj.weight.grad.dtype)  # its shard's gradient
            if step == 1 and rank == 1:
                model.projector.layers[0].weight.grad.view(-1)[0] = float("inf")
            plugin.clip_grad_norm_()
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            changed = sorted(n for n, p in model.named_parameters() if p.requires_grad and not torch.equal(
                p.detach().to_local() if hasattr(p, "to_local") else p.detach(), before[n]))
            facts.append({"changed": changed, "scale": accelerator.scaler.get_scale(), "grad": grad,
                          "stepped": sorted(optimizer.stepped),
                          "schedulers_stepped": sorted(n for n, s in scheduler.schedulers.items()
                                                       if s.last_epoch != epochs[n])})
    refused = None
    try:  # fp16 with an offloaded FSDP module: refused, naming the module and key
        offloaded = OmniPlugin(modules={"vision": {"trainable": False}, "llm": {"parallel": "fsdp", "fsdp_plugin": {
            "cpu_offload": True}}}, defaults={"learning_rate": 1e-3})
        fresh = Accelerator(cpu=True)  # after the plugin: its TrainingArguments reset Accelerate's state
        fresh.scaler = torch.amp.GradScaler("cpu")
        offloaded.prepare(fresh, helpers.tiny_model(), num_training_steps=4)
    except ValueError as err:
        refused = str(err)
    return {"steps": facts, "host_reads": reads.found, "offload_refused": refused,
            "collectives": sorted(collectives.seen), "shard": str(model.llm.model.layers[0].self_attn.q_proj.weight.dtype)}


class GeneratingCaptioner(mixed_modality.MixedCaptioner, GenerationMixin):
    """The captioner with transformers' `generate` (run without a KV cache: each forward is given every input)."""


def windows(out_dir: str) -> dict:
    """A loop over OmniPlugin: one window of 2 micro-steps (LAYOUT steps 1 and 2: an image on one rank each)
    agreed with `plugin.agree_window`, then `generate` of 6 tokens with an image on rank 0 only; hf_omni's
    side-group collectives counted for each."""
    base = mixed_modality.mixed_model()
    model = GeneratingCaptioner.from_modules(base.omni_modules(), processors=base.processors)
    plugin = OmniPlugin(modules=MODULES, defaults={"learning_rate": 1e-3}, output_dir=os.path.join(out_dir, "w"))
    model, optimizer, _ = plugin.prepare(Accelerator(cpu=True), model, num_training_steps=2)
    data, rank = mixed_modality.MixedCaptions(model, HAS_IMAGE), dist.get_rank()
    window = [mixed_modality.collate([data[4 * step + 2 * rank + i] for i in range(2)]) for step in (1, 2)]
    with ReceivedBytes(group=checkpoint_group()) as agreed:
        plugin.agree_window(window)
        for i, batch in enumerate(window):
            with plugin.no_sync() if i == 0 else contextlib.nullcontext():
                model(**batch).loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    prompt = {k: v for k, v in window[0].items() if k != "labels"}
    with ReceivedBytes(group=checkpoint_group()) as generated:
        out = model.eval().generate(**prompt, max_new_tokens=6, min_new_tokens=6, do_sample=False, use_cache=False,
                                    suppress_tokens=[model.processors["llm"].unk_token_id])  # no new image slot
    return {"window": agreed.calls, "generate": generated.calls, "tokens": out.shape[1] - prompt["input_ids"].shape[1]}


def main(out_dir: str):
    dummies = dummies_run()
    results = {"online": train(out_dir, "online", MODULES)}  # its arguments make the process group
    rank = dist.get_rank()
    results["online"]["dummies"] = len(dummies)
    results["offline"] = train(out_dir, "offline", OFFLINE, offline_modules=["vision"])
    results["offload"] = offload(out_dir)
    results["grouped"] = grouped(out_dir)
    results["fp16"] = fp16(out_dir)
    results["windows"] = windows(out_dir)
    for name, facts in results.items():
        with open(os.path.join(out_dir, f"{name}-rank{rank}.json"), "w") as f:
            json.dump(facts, f)
    dist.barrier()


if __name__ == "__main__":
    main(sys.argv[1])
    end_distributed()
