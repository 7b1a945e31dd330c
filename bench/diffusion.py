"""A diffusers pipeline under OmniTrainer vs the diffusers-style hand-written loop at 2 gloo ranks on CPU: step time
(the two run step by step alternating, so load from other processes hits both alike) and save time.

    python bench/diffusion.py [--rounds N]     # launches itself with accelerate (2 processes); default 5 rounds

The pipeline: tests/tiny_pipelines.py's SD-style one made bigger (32x32 images, 16x16 latents, UNet with
block_out_channels (32, 64), CLIP text encoder of hidden 64 with 2 layers), its tokenizer and `sd_loss`. Both step
variants: UNet trained at 1e-3, text encoder at 1e-4, VAE frozen, AdamW, no clipping, batch 4/rank, rank r's
step s on rows [(2s + r) * 4, +4) (what OmniTrainer's sequential sampler gives it), the same seeded weights:
  omni   OmniTrainer, modules {unet: parallel fsdp, text_encoder: parallel ddp, vae: trainable false}
  loop   torch `fully_shard` on the UNet's `_no_split_modules` blocks (bottom up) and the UNet, DDP
         (find_unused_parameters=True, as OmniTrainer resolves) on the text encoder, one AdamW per trained module
Save (each round's trained models, the two alternating; to os.sync() and every rank out of the call):
  omni      trainer.save_model(dir): every rank writes its own rows of the sharded UNet, rank 0 the rest
  diffusers get_model_state_dict(unet, full_state_dict + cpu_offload) to rank 0, a UNet built from it (meta +
            assign), StableDiffusionPipeline(...).save_pretrained(dir) on rank 0
The omni-trained state is also saved the diffusers way: both folders, loaded with StableDiffusionPipeline.
from_pretrained, must hold equal weights (asserted)."""

from __future__ import annotations

import functools
import os
import shutil
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]
import torch
import torch.distributed as dist
from diffusers import AutoencoderKL, DDPMScheduler, UNet2DConditionModel
from diffusers import StableDiffusionPipeline as SDPipeline
from tiny_pipelines import CAPTIONS, clip_tokenizer, collate, sd_loss
from torch.distributed.checkpoint import state_dict as dcp_state
from transformers import CLIPTextConfig, CLIPTextModel

WARMUP, MEASURED, BATCH, ROUNDS, WORLD = 5, 20, 4, 5, 2
IMAGE, LATENT, HIDDEN, MAX_LEN = 32, 16, 64, 16
LRS = {"unet": 1e-3, "text_encoder": 1e-4}
MODULES = {"unet": {"learning_rate": LRS["unet"], "parallel": "fsdp"},
           "text_encoder": {"learning_rate": LRS["text_encoder"], "parallel": "ddp"}, "vae": {"trainable": False}}
OUT = "/tmp/hf_omni_bench/diffusion"


def launch():
    cmd = ["accelerate", "launch", "--multi_gpu", "--num_processes", str(WORLD), "--num_machines", "1",
           "--mixed_precision", "no", "--dynamo_backend", "no", __file__, "--worker", *sys.argv[1:]]
    sys.exit(subprocess.call(cmd))


def pipeline(seed: int = 0):
    tok = clip_tokenizer()
    torch.manual_seed(seed)
    unet = UNet2DConditionModel(
        sample_size=LATENT, in_channels=4, out_channels=4, layers_per_block=1, block_out_channels=(32, 64),
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"), up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
        cross_attention_dim=HIDDEN, attention_head_dim=8, norm_num_groups=8).eval()
    torch.manual_seed(seed + 1)
    vae = AutoencoderKL(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 2,
                        up_block_types=("UpDecoderBlock2D",) * 2, block_out_channels=(8, 16), layers_per_block=1,
                        latent_channels=4, norm_num_groups=4, sample_size=IMAGE).eval()
    torch.manual_seed(seed + 2)
    text_encoder = CLIPTextModel(CLIPTextConfig(
        vocab_size=len(tok), hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=MAX_LEN, projection_dim=HIDDEN, hidden_act="gelu", layer_norm_eps=1e-5,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)).eval()
    scheduler = DDPMScheduler(beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear",
                              num_train_timesteps=1000, prediction_type="epsilon", steps_offset=1, clip_sample=False)
    return SDPipeline(vae=vae, text_encoder=text_encoder, tokenizer=tok, unet=unet, scheduler=scheduler,
                                   safety_checker=None, feature_extractor=None, requires_safety_checker=False)


def make_rows(n: int) -> list[dict]:
    tok, g = clip_tokenizer(), torch.Generator().manual_seed(0)
    return [{"pixel_values": torch.rand(3, IMAGE, IMAGE, generator=g) * 2 - 1,
             "input_ids": tok(CAPTIONS[i % len(CAPTIONS)], padding="max_length", max_length=MAX_LEN, truncation=True,
                              return_tensors="pt").input_ids[0],
             "latent_noise": torch.randn(4, LATENT, LATENT, generator=g),
             "noise": torch.randn(4, LATENT, LATENT, generator=g),
             "timesteps": torch.randint(0, 1000, (), generator=g)} for i in range(n)]


def loop_setup(rows):
    """The hand-written loop's modules and optimizers; returns (one_step, pipeline)."""
    from accelerate.utils import get_module_children_bottom_up
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel

    rank, world = dist.get_rank(), dist.get_world_size()
    pipe = pipeline()
    unet, text_encoder, vae = pipe.unet, pipe.text_encoder, pipe.vae
    vae.requires_grad_(False).eval()
    for m in (unet, text_encoder):
        m.requires_grad_(True).train()
    for sub in get_module_children_bottom_up(unet)[:-1]:
        if type(sub).__name__ in unet._no_split_modules:
            fully_shard(sub)
    fully_shard(unet)
    ddp = DistributedDataParallel(text_encoder, find_unused_parameters=True)
    opts = [torch.optim.AdamW(m.parameters(), lr=LRS[n], weight_decay=0.0)
            for n, m in (("unet", unet), ("text_encoder", text_encoder))]
    done = [0]

    def one_step():
        start = (done[0] * world + rank) * BATCH
        batch = collate([rows[(start + i) % len(rows)] for i in range(BATCH)])
        for o in opts:
            o.zero_grad()
        sd_loss(unet, vae, ddp, pipe.scheduler, batch).backward()
        for o in opts:
            o.step()
        done[0] += 1

    return one_step, pipe


def run_paired(rows, out):
    """OmniTrainer's steps and the loop's, alternating: each OmniTrainer step's end runs one loop step, so load
    from other processes hits both alike. omni: its step end to its next step end, less the loop step between."""
    from diffusion_runs import Rows, SDModel
    from helpers import make_args
    from transformers import TrainerCallback

    from hf_omni import OmniTrainer

    loop_step, loop_pipe = loop_setup(rows)
    times, last = {"omni": [], "loop": []}, [None]

    class Paired(TrainerCallback):
        def on_step_end(self, *args, **kwargs):
            now = time.perf_counter()
            if last[0] is not None:
                times["omni"].append(now - last[0])
            loop_step()
            last[0] = time.perf_counter()
            times["loop"].append(last[0] - now)

    args = make_args(out, modules=MODULES, per_device_train_batch_size=BATCH, max_steps=WARMUP + MEASURED,
                     lr_scheduler_type="constant", max_grad_norm=0.0, logging_steps=10_000)
    trainer = OmniTrainer(model=SDModel.from_pipeline(pipeline()), args=args, train_dataset=Rows(rows),
                          callbacks=[Paired()])
    trainer.train()
    return {k: v[WARMUP:] for k, v in times.items()}, trainer, loop_pipe


def save_diffusers(pipe, out):
    """The diffusers scripts' end of training, with an FSDP2 UNet: the full state gathered to rank 0 (CPU), a
    plain UNet built from it, the pipeline written by rank 0 alone."""

    options = dcp_state.StateDictOptions(full_state_dict=True, cpu_offload=True)
    full = dcp_state.get_model_state_dict(pipe.unet, options=options)
    if dist.get_rank() == 0:
        with torch.device("meta"):
            unet = UNet2DConditionModel.from_config(pipe.unet.config)
        unet.load_state_dict(full, assign=True)
        SDPipeline(vae=pipe.vae, text_encoder=pipe.text_encoder, tokenizer=pipe.tokenizer, unet=unet,
                                scheduler=pipe.scheduler, safety_checker=None, feature_extractor=None,
                                requires_safety_checker=False).save_pretrained(out)


def timed(fn) -> float:
    dist.barrier()
    start = time.perf_counter()
    fn()
    os.sync()
    dist.barrier()
    return time.perf_counter() - start


def weights(folder: str) -> dict:
    pipe = SDPipeline.from_pretrained(folder, safety_checker=None, requires_safety_checker=False)
    return {f"{n}.{k}": v for n in ("unet", "text_encoder", "vae") for k, v in getattr(pipe, n).state_dict().items()}


def omni_pipeline_modules(trainer):
    """For save_diffusers: the sharded UNet; text encoder (`replicate` made it DDPCLIPTextModel), VAE unwrapped."""
    ref, model = pipeline(), trainer.model
    for name in ("text_encoder", "vae"):
        getattr(ref, name).load_state_dict(getattr(model, name).state_dict())
    ref.unet = model.unet
    return ref


def worker(rounds: int):
    from accelerate import PartialState

    PartialState(cpu=True)
    spread, rank = (lambda v: f"{min(v):.3g}-{max(v):.3g}"), dist.get_rank()
    rows = make_rows(WORLD * BATCH * (WARMUP + MEASURED))
    if rank == 0:
        shutil.rmtree(OUT, ignore_errors=True)
    dist.barrier()
    step, save = {"omni": [], "loop": []}, {"omni": [], "diffusers": []}  # per round: median step (s), save (s)
    for r in range(rounds):
        times, trainer, loop_pipe = run_paired(rows, os.path.join(OUT, f"run_{r}"))
        for name in times:
            step[name].append(statistics.median(times[name]))
        dist.barrier()
        savers = {"omni": functools.partial(trainer.save_model, f"{OUT}/omni_{r}"),
                  "diffusers": functools.partial(save_diffusers, loop_pipe, f"{OUT}/loop_{r}")}
        for name in (list(savers) if r % 2 == 0 else list(savers)[::-1]):  # alternating which goes first
            save[name].append(timed(savers[name]))
    # the same state (omni-trained) written both ways: every weight equal once loaded by diffusers
    save_diffusers(omni_pipeline_modules(trainer), os.path.join(OUT, "omni_state_diffusers"))
    dist.barrier()
    if rank == 0:
        ours, theirs = (weights(os.path.join(OUT, d)) for d in (f"omni_{rounds - 1}", "omni_state_diffusers"))
        loop = weights(os.path.join(OUT, f"loop_{rounds - 1}"))
        assert ours.keys() == theirs.keys() == loop.keys(), (ours.keys() ^ theirs.keys(), ours.keys() ^ loop.keys())
        unequal = [k for k in ours if not torch.equal(ours[k], theirs[k])]
        assert not unequal, f"omni save_model and the diffusers way differ in {unequal[:5]}"
        drift = max((ours[k] - loop[k]).abs().max().item() for k in ours)
        omni_b, diff_b = (sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(os.path.join(OUT, d))
                              for f in fs) for d in ("omni_0", "loop_0"))
        weight_b = {n: sum(v.numel() * v.element_size() for k, v in ours.items() if k.startswith(n + "."))
                    for n in ("unet", "text_encoder", "vae")}
        step_ratio = [a / b for a, b in zip(step["omni"], step["loop"])]
        save_ratio = [a / b for a, b in zip(save["omni"], save["diffusers"])]
        med, msave = ({k: statistics.median(v) for k, v in d.items()} for d in (step, save))
        print(f"\nbench/diffusion.py: SD-style pipeline (UNet {weight_b['unet'] / 1e6:.1f} MB, text encoder "
              f"{weight_b['text_encoder'] / 1e6:.1f} MB, VAE {weight_b['vae'] / 1e6:.1f} MB fp32), {WORLD} gloo "
              f"ranks, batch {BATCH}/rank, {rounds} rounds x {MEASURED} measured steps (after {WARMUP})\n")
        print("| measure | OmniTrainer | diffusers-style | ratio (median of rounds) | ratio spread over rounds |")
        print("|---|---|---|---|---|")
        print(f"| step time (ms, median; round medians {spread([1000 * x for x in step['omni']])} / "
              f"{spread([1000 * x for x in step['loop']])}) | {1000 * med['omni']:.1f} | "
              f"{1000 * med['loop']:.1f} | {statistics.median(step_ratio):.3f} | {spread(step_ratio)} |")
        print(f"| save to os.sync() (s, median; rounds {spread(save['omni'])} / {spread(save['diffusers'])}) | "
              f"{msave['omni']:.3f} | {msave['diffusers']:.3f} | {statistics.median(save_ratio):.3f} | "
              f"{spread(save_ratio)} |")
        print(f"| bytes written (pipeline folder) | {omni_b} | {diff_b} | {omni_b / diff_b:.4f} | - |")
        print("\nper round (ms, s):", {k: [round(1000 * x, 1) for x in v] for k, v in step.items()},
              {k: [round(x, 3) for x in v] for k, v in save.items()})
        print(f"\nsame state saved both ways, loaded with StableDiffusionPipeline.from_pretrained: {len(ours)} tensors "
              f"equal (asserted); omni-trained vs loop-trained weights after {WARMUP + MEASURED} steps: max |diff| "
              f"{drift:.2e}")
    dist.barrier()


if __name__ == "__main__":
    n = int(sys.argv[sys.argv.index("--rounds") + 1]) if "--rounds" in sys.argv else ROUNDS
    if "--worker" in sys.argv:
        worker(n)
        from launching import end_distributed
        end_distributed()
    else:
        launch()
