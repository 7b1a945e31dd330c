"""Diffusers pipelines adopted as composed models (tiny_pipelines.py), and the runs shared by the 1-process tests
(tests/test_diffusion.py) and the 2-rank script (tests/scripts/mp_diffusion.py): trained by OmniTrainer,
checkpointed, resumed, exported as pipeline folders.

The forwards compute the training loss of diffusers' own scripts (`sd_loss`: train_text_to_image.py, epsilon;
`flux_loss`: train_dreambooth_flux.py, flow matching), every random draw from the batch. They take no `**kwargs`:
the loss is a mean over the batch, so Trainer averages it over ranks and accumulation steps itself."""

from __future__ import annotations

import os

import torch
from torch.distributed.fsdp import FSDPModule
from helpers import full_state, make_args, step_losses
from tiny_pipelines import (
    flux_loss, flux_modules, flux_pipeline, flux_rows, reference_train, sample, sd_loss, sd_modules, sd_pipeline,
    sd_rows, wan_loss, wan_modules, wan_pipeline, wan_rows,
)
from transformers.utils import ModelOutput

from hf_omni import OmniModel, OmniTrainer


class SDModel(OmniModel):
    def forward(self, pixel_values, input_ids, latent_noise, noise, timesteps):
        batch = dict(pixel_values=pixel_values, input_ids=input_ids, latent_noise=latent_noise, noise=noise,
                     timesteps=timesteps)
        return ModelOutput(loss=sd_loss(self.unet, self.vae, self.text_encoder, self.scheduler, batch))


class FluxModel(OmniModel):
    def forward(self, pixel_values, input_ids, input_ids_2, latent_noise, noise, sigmas):
        batch = dict(pixel_values=pixel_values, input_ids=input_ids, input_ids_2=input_ids_2,
                     latent_noise=latent_noise, noise=noise, sigmas=sigmas)
        return ModelOutput(loss=flux_loss(self.transformer, self.vae, self.text_encoder, self.text_encoder_2,
                                          self.scheduler, batch))


class WanModel(OmniModel):
    def forward(self, video, input_ids, latent_noise, noise, sigmas):
        batch = dict(video=video, input_ids=input_ids, latent_noise=latent_noise, noise=noise, sigmas=sigmas)
        return ModelOutput(loss=wan_loss(self.transformer, self.vae, self.text_encoder, self.scheduler, batch))


LORA = {"r": 4, "lora_alpha": 8, "init_lora_weights": "gaussian"}
# SD: the UNet sharded, the text encoder replicated at its own learning rate, the VAE frozen
SD = {"unet": {"learning_rate": 1e-3, "parallel": "fsdp"},
      "text_encoder": {"learning_rate": 1e-4, "parallel": "ddp"}, "vae": {"trainable": False}}
SD_LRS = {"unet": 1e-3, "text_encoder": 1e-4}
# Flux: the transformer sharded, both text encoders and the VAE frozen
FLUX = {"transformer": {"learning_rate": 1e-3, "parallel": "fsdp"}, "text_encoder": {"trainable": False},
        "text_encoder_2": {"trainable": False}, "vae": {"trainable": False}}
FLUX_LRS = {"transformer": 1e-3}
# Flux with LoRA on the transformer (sharded) and on the CLIP text encoder (replicated)
FLUX_LORA = {"transformer": {"learning_rate": 1e-2, "parallel": "fsdp",
                             "lora": {**LORA, "target_modules": ["to_q", "to_k", "to_v", "to_out.0"]}},
             "text_encoder": {"learning_rate": 1e-2, "parallel": "ddp",
                              "lora": {**LORA, "target_modules": ["q_proj", "v_proj"]}},
             "text_encoder_2": {"trainable": False}, "vae": {"trainable": False}}
# Wan: the video transformer sharded over the data and sequence ranks together, its sequence split over 2 ranks
# (diffusers' own Ulysses attention); the text encoder and the VAE frozen
WAN_SP = {"transformer": {"learning_rate": 1e-3, "parallel": "fsdp", "parallelism": {"sp_size": 2}},
          "text_encoder": {"trainable": False}, "vae": {"trainable": False}}
WAN_LRS = {"transformer": 1e-3}
KINDS = {"sd": (SDModel, sd_pipeline, sd_rows), "flux": (FluxModel, flux_pipeline, flux_rows),
         "wan": (WanModel, wan_pipeline, wan_rows)}
STEPS, BATCH, ROWS = 4, 4, 16  # global batch 4: 4 rows at 1 process, 2 per rank at 2 ranks


class Rows(torch.utils.data.Dataset):
    def __init__(self, rows: list[dict]):
        self.rows = rows

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return self.rows[i]


def model(kind: str, seed: int = 0) -> OmniModel:
    cls, build, _ = KINDS[kind]
    return cls.from_pipeline(build(seed))


def data(kind: str) -> Rows:
    return Rows(KINDS[kind][2](ROWS))


def trainer(kind: str, out: str, modules: dict, batch: int, the_model=None, **overrides) -> OmniTrainer:
    """OmniTrainer as diffusers' scripts train: constant learning rate, no clipping, no weight decay."""
    settings = dict(modules=modules, per_device_train_batch_size=batch, max_steps=STEPS, lr_scheduler_type="constant",
                    max_grad_norm=0.0, save_strategy="steps", save_steps=2)
    args = make_args(out, **{**settings, **overrides})
    return OmniTrainer(model=the_model or model(kind), args=args, train_dataset=data(kind))


def run(kind: str, out: str, modules: dict, batch: int, resume: bool = True) -> dict:
    """4 steps saved every 2, exported as a pipeline folder (`save_model`); the same run resumed from step 2.
    Every rank calls it; states are full tensors on every rank."""
    first = trainer(kind, os.path.join(out, "run"), modules, batch)
    seen = []  # Wan: the tokens its second block runs on while sampling (its first splits the sequence on entry)
    if kind == "wan":
        first.model.transformer.blocks[1].register_forward_pre_hook(lambda m, a: seen.append(tuple(a[0].shape)))
    first.train()
    seen.clear()
    result = {"losses": step_losses(first), "state": full_state(first.model), "tokens": seen,
              "sample": sample(first.model.to_pipeline()),  # every rank: the sharded modules sample together
              "checkpointing": {n: bool(getattr(m, "gradient_checkpointing", False))
                                for n, m in first.model.omni_modules().items()},
              "units": {n: sorted({type(m).__name__.removeprefix("FSDP") for m in module.modules()
                                   if isinstance(m, FSDPModule)}) for n, module in first.model.omni_modules().items()}}
    first.save_model(os.path.join(out, "export"))
    if resume:
        again = trainer(kind, os.path.join(out, "resumed"), modules, batch)
        again.train(resume_from_checkpoint=os.path.join(out, "run", "checkpoint-2"))
        result.update(resumed_losses=step_losses(again)[-2:], resumed_state=full_state(again.model))
    return result


def reference(kind: str, steps: int = 4):
    """diffusers' script loop on a fresh copy of the pipeline: (losses, the trained pipeline)."""
    if kind == "sd":
        pipe = sd_pipeline()
        losses = reference_train(sd_modules(pipe), sd_loss, sd_rows(16), steps, 4, SD_LRS, list(SD_LRS))
    elif kind == "wan":
        pipe = wan_pipeline()
        losses = reference_train(wan_modules(pipe), wan_loss, wan_rows(16), steps, 4, WAN_LRS, list(WAN_LRS))
    else:
        pipe = flux_pipeline()
        losses = reference_train(flux_modules(pipe), flux_loss, flux_rows(16), steps, 4, FLUX_LRS, list(FLUX_LRS))
    return losses, pipe.to("cpu")


def pipeline_state(pipe) -> dict:
    return {f"{n}.{k}": v for n, m in pipe.components.items() if isinstance(m, torch.nn.Module)
            for k, v in m.state_dict().items()}
