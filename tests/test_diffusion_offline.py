"""Per-encoder offline caches in a diffusion pipeline (tests/diffusion_runs.py's Flux-style one): the VAE's latent
distribution and the T5 encoder's hidden states cached with `@offline_encoder` while the CLIP encoder and the
transformer train. The VAE's cache holds the distribution's parameters; the training step draws the sample from
the training RNG, as online training does, so offline equals online."""

import pytest
import torch
from diffusers.models.autoencoders.vae import DiagonalGaussianDistribution
from diffusers.pipelines.flux.pipeline_flux import FluxPipeline
from diffusion_runs import trainer
from helpers import full_state, step_losses
from tiny_pipelines import flux_pipeline
from transformers.utils import ModelOutput

from hf_omni import OmniModel, offline_encoder

MODULES = {"transformer": {"learning_rate": 1e-3}, "text_encoder": {"learning_rate": 1e-4},
           "text_encoder_2": {"trainable": False}, "vae": {"trainable": False}}


class CachedFlux(OmniModel):
    """train_dreambooth_flux.py's loss, the latent sampled in the step (`latent_dist.sample()`, training RNG)."""

    @offline_encoder(module="vae", inputs=["pixel_values"], output="latent_parameters")
    def encode_image(self, pixel_values):
        return self.vae.encode(pixel_values).latent_dist.parameters

    @offline_encoder(module="text_encoder_2", inputs=["input_ids_2"], output="t5_states")
    def encode_t5(self, input_ids_2):
        return self.text_encoder_2(input_ids_2)[0]

    def forward(self, input_ids, noise, sigmas, pixel_values=None, latent_parameters=None, input_ids_2=None,
                t5_states=None):
        params = latent_parameters if latent_parameters is not None else self.encode_image(pixel_values)
        t5_states = t5_states if t5_states is not None else self.encode_t5(input_ids_2)
        config = self.vae.config
        x0 = (DiagonalGaussianDistribution(params).sample() - config.shift_factor) * config.scaling_factor
        b, c, h, w = x0.shape
        sig = sigmas.to(x0.dtype).view(b, 1, 1, 1)
        noisy = (1 - sig) * x0 + sig * noise
        pooled = self.text_encoder(input_ids).pooler_output
        ids = FluxPipeline._prepare_latent_image_ids(b, h // 2, w // 2, x0.device, x0.dtype)
        pred = self.transformer(hidden_states=FluxPipeline._pack_latents(noisy, b, c, h, w),
                                timestep=sigmas.to(x0.dtype), guidance=torch.full((b,), 3.5),
                                pooled_projections=pooled, encoder_hidden_states=t5_states,
                                txt_ids=torch.zeros(t5_states.shape[1], 3), img_ids=ids, return_dict=False)[0]
        pred = FluxPipeline._unpack_latents(pred, h * 2, w * 2, 2)
        return ModelOutput(loss=torch.nn.functional.mse_loss(pred, noise - x0))


def run(out, offline: list[str], cache=None, modules=None, model=None, **extra):
    model = model or CachedFlux.from_pipeline(flux_pipeline())
    extra.update({"offline_cache_dir": str(cache)} if cache else {})
    run_ = trainer("flux", str(out), modules or MODULES, batch=4, the_model=model, offline_modules=offline,
                   save_strategy="no", **extra)
    run_.train()
    return run_


def test_offline_vae_and_t5_equal_online_while_clip_trains(tmp_path):
    online = run(tmp_path / "online", [])
    offline = run(tmp_path / "offline", ["vae", "text_encoder_2"], tmp_path / "cache")
    assert step_losses(offline) == pytest.approx(step_losses(online), abs=1e-5)
    assert offline.plugin.wrapped["vae"] == "offline" and offline.plugin.wrapped["text_encoder_2"] == "offline"
    assert all(p.is_meta for n in ("vae", "text_encoder_2") for p in getattr(offline.model, n).parameters())
    theirs = full_state(online.model)
    for name, value in full_state(offline.model).items():
        assert (value - theirs[name]).abs().max() <= 1e-5, name
    # the caches outlive a change of the trained modules (read_only: a stale cache would be refused) ...
    frozen_clip = {**MODULES, "text_encoder": {"trainable": False}}
    run(tmp_path / "again", ["vae", "text_encoder_2"], tmp_path / "cache", frozen_clip, offline_cache="read_only")
    # ... and not a change of an encoder's weights
    changed = CachedFlux.from_pipeline(flux_pipeline())
    with torch.no_grad():
        changed.vae.encoder.conv_in.weight[0, 0, 0, 0] += 1e-3
    with pytest.raises(ValueError, match=r"module 'vae' is not valid \(weights changed\)"):
        run(tmp_path / "changed", ["vae", "text_encoder_2"], tmp_path / "cache", model=changed,
            offline_cache="read_only")
