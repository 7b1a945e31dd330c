"""Tiny, offline, seeded diffusion pipelines (Stable-Diffusion-, Flux- and Wan-style) with reference training losses.

Why: the diffusion-pipeline support must be tested without the Hub. Every component is built from a config with
seeded random weights, and both tokenizers are built in code (no vocab download). The loss functions follow
diffusers' `examples/text_to_image/train_text_to_image.py` (epsilon prediction) and
`examples/dreambooth/train_dreambooth_flux.py` (flow matching), but take every random draw from the batch, so the
same batch gives the same loss bit for bit. `reference_train` is the hand-written loop a trainer is compared with.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from diffusers import (
    AutoencoderKL, AutoencoderKLWan, DDPMScheduler, FlowMatchEulerDiscreteScheduler, FluxPipeline,
    FluxTransformer2DModel, StableDiffusionPipeline, UNet2DConditionModel, WanPipeline, WanTransformer3DModel,
)
from transformers import CLIPTextConfig, CLIPTextModel, CLIPTokenizer, T5Config, T5EncoderModel, T5Tokenizer

CAPTIONS = ["a cat", "a red dog", "two birds in the sky", "a small house", "the blue sea", "a cat on a mat"]
MAX_LEN = 16  # tokenizer model_max_length (CLIP) and T5 max_sequence_length: pass `max_sequence_length=MAX_LEN`
IMAGE = 16  # image side; both VAEs downsample by 2 -> 8x8 latents (Flux packs them into 4x4 tokens of 16 channels)
LATENT = IMAGE // 2
WORDS = sorted({w for c in CAPTIONS for w in c.split()})
HIDDEN = 32  # CLIP hidden size = T5 d_model = UNet cross_attention_dim = Flux joint/pooled projection dims


def _bytes_to_unicode() -> list[str]:
    """GPT-2 byte -> printable-char table, the alphabet the CLIP byte-level pre-tokenizer emits."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    rest = [b for b in range(256) if b not in bs]
    bs, cs = bs + rest, bs + [256 + i for i in range(len(rest))]
    return [chr(c) for _, c in sorted(zip(bs, cs))]


def clip_tokenizer() -> CLIPTokenizer:
    """Byte-level BPE over all 256 byte chars (alone and with the `</w>` word end) plus left-to-right merges that
    make every caption word one token; anything else falls back to characters. ids: 0 bos, 1 eos (= pad)."""
    vocab = {"<|startoftext|>": 0, "<|endoftext|>": 1}
    for ch in _bytes_to_unicode():
        vocab.setdefault(ch, len(vocab))
        vocab.setdefault(ch + "</w>", len(vocab))
    merges = []
    for w in WORDS:
        left, *rest = [*w[:-1], w[-1] + "</w>"]
        for right in rest:
            if (left, right) not in merges:
                merges.append((left, right))
            left += right
            vocab.setdefault(left, len(vocab))
    return CLIPTokenizer(vocab=vocab, merges=merges, model_max_length=MAX_LEN)


def t5_tokenizer() -> T5Tokenizer:
    """Unigram (SentencePiece-style, `▁` word prefix) with whole caption words plus single letters as fallback,
    no sentinel tokens. ids: 0 <pad>, 1 </s>, 2 <unk>."""
    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("▁", -2.0)]
    pieces += [("▁" + w, -1.0) for w in WORDS]
    pieces += [(c, -5.0) for c in "abcdefghijklmnopqrstuvwxyz0123456789"]
    return T5Tokenizer(vocab=pieces, extra_ids=0, model_max_length=MAX_LEN)


def _clip_text_encoder(tok: CLIPTokenizer, seed: int) -> CLIPTextModel:
    torch.manual_seed(seed)
    return CLIPTextModel(CLIPTextConfig(
        vocab_size=len(tok), hidden_size=HIDDEN, intermediate_size=37, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=MAX_LEN, projection_dim=HIDDEN, hidden_act="gelu", layer_norm_eps=1e-5,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
    )).eval()


def _vae(seed: int, **kw) -> AutoencoderKL:
    torch.manual_seed(seed)
    return AutoencoderKL(
        in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2, block_out_channels=(8, 16), layers_per_block=1,
        latent_channels=4, norm_num_groups=4, sample_size=IMAGE, **kw,
    ).eval()


def sd_pipeline(seed: int = 0) -> StableDiffusionPipeline:
    """Stable-Diffusion-style: UNet (8x8 latents, 4 channels) + KL VAE + CLIP text encoder + DDPM."""
    tok = clip_tokenizer()
    torch.manual_seed(seed)
    unet = UNet2DConditionModel(
        sample_size=LATENT, in_channels=4, out_channels=4, layers_per_block=1, block_out_channels=(8, 16),
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"), up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
        cross_attention_dim=HIDDEN, attention_head_dim=2, norm_num_groups=4,
    ).eval()
    scheduler = DDPMScheduler(beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear",
                              num_train_timesteps=1000, prediction_type="epsilon", steps_offset=1,
                              clip_sample=False)  # SD v1 values; others raise deprecation warnings
    return StableDiffusionPipeline(
        vae=_vae(seed + 1), text_encoder=_clip_text_encoder(tok, seed + 2), tokenizer=tok, unet=unet,
        scheduler=scheduler, safety_checker=None, feature_extractor=None, requires_safety_checker=False,
    )


def flux_pipeline(seed: int = 0) -> FluxPipeline:
    """Flux-style: MMDiT transformer with guidance embedding over 2x2-packed latents + KL VAE with Flux's
    shift/scaling factors + CLIP (pooled) + T5 encoder + flow-matching Euler scheduler with dynamic shifting."""
    tok, tok2 = clip_tokenizer(), t5_tokenizer()
    torch.manual_seed(seed)
    transformer = FluxTransformer2DModel(
        patch_size=1, in_channels=16, num_layers=1, num_single_layers=1, attention_head_dim=16,
        num_attention_heads=2, joint_attention_dim=HIDDEN, pooled_projection_dim=HIDDEN, guidance_embeds=True,
        axes_dims_rope=(4, 4, 8),
    ).eval()
    torch.manual_seed(seed + 3)
    t5 = T5EncoderModel(T5Config(
        vocab_size=len(tok2), d_model=HIDDEN, d_kv=8, d_ff=37, num_layers=2, num_heads=4,
        relative_attention_num_buckets=8, dropout_rate=0.0, feed_forward_proj="gated-gelu",
        pad_token_id=0, eos_token_id=1, decoder_start_token_id=0,
    )).eval()
    scheduler = FlowMatchEulerDiscreteScheduler(
        num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
        base_image_seq_len=256, max_image_seq_len=4096,
    )
    vae = _vae(seed + 1, use_quant_conv=False, use_post_quant_conv=False, shift_factor=0.0609, scaling_factor=1.5035)
    return FluxPipeline(scheduler=scheduler, vae=vae, text_encoder=_clip_text_encoder(tok, seed + 2), tokenizer=tok,
                        text_encoder_2=t5, tokenizer_2=tok2, transformer=transformer)


FRAMES, VIDEO = 9, 32  # Wan: 9 frames of 32 x 32 -> 3 latent frames of 4 x 4 (16 channels) -> 12 tokens of 2 x 2


def wan_pipeline(seed: int = 0) -> WanPipeline:
    """Wan-style video: a 3-D DiT (2 heads, 2 blocks) over (1, 2, 2) patches of the latents of a causal 3-D VAE
    (4x temporal, 8x spatial), a T5 encoder, flow matching (diffusers' own tests' sizes, 32 x 32 frames)."""
    tok = t5_tokenizer()
    torch.manual_seed(seed)
    transformer = WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=16, out_channels=16,
        text_dim=HIDDEN, freq_dim=256, ffn_dim=32, num_layers=2, cross_attn_norm=True,
        qk_norm="rms_norm_across_heads", rope_max_seq_len=32,
    ).eval()
    torch.manual_seed(seed + 1)
    vae = AutoencoderKLWan(base_dim=3, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                           temperal_downsample=[False, True, True]).eval()
    torch.manual_seed(seed + 2)
    t5 = T5EncoderModel(T5Config(
        vocab_size=len(tok), d_model=HIDDEN, d_kv=8, d_ff=37, num_layers=2, num_heads=4,
        relative_attention_num_buckets=8, dropout_rate=0.0, feed_forward_proj="gated-gelu",
        pad_token_id=0, eos_token_id=1, decoder_start_token_id=0,
    )).eval()
    return WanPipeline(tokenizer=tok, text_encoder=t5, vae=vae, transformer=transformer,
                       scheduler=FlowMatchEulerDiscreteScheduler(shift=7.0))


def sample(pipe, seed: int = 0, steps: int = 2) -> torch.Tensor:
    """Two-step sample of "a cat" as a (1, 3, IMAGE, IMAGE) tensor in [0, 1] (Wan: (1, FRAMES, 3, VIDEO, VIDEO))."""
    if isinstance(pipe, WanPipeline):
        return pipe(prompt="a cat", negative_prompt="", num_inference_steps=steps, height=VIDEO, width=VIDEO,
                    num_frames=FRAMES, max_sequence_length=MAX_LEN, output_type="pt",
                    generator=torch.Generator().manual_seed(seed)).frames
    extra = {"max_sequence_length": MAX_LEN} if isinstance(pipe, FluxPipeline) else {}
    return pipe(prompt="a cat", num_inference_steps=steps, height=IMAGE, width=IMAGE, output_type="pt",
                generator=torch.Generator().manual_seed(seed), **extra).images


def realign(pipe):
    """Copy every parameter and buffer of the pipeline's modules into fresh memory; returns the pipeline.
    Why: `from_pretrained` leaves weights as views into the (mmapped) safetensors file at offsets that are not
    64-byte aligned, and CPU BLAS/oneDNN kernels then take another SIMD path: outputs differ by ~1 ulp. After this
    copy a loaded pipeline samples bit-identically to the one that was saved."""
    with torch.no_grad():
        for m in pipe.components.values():
            if isinstance(m, torch.nn.Module):
                for t in list(m.parameters()) + list(m.buffers()):
                    t.data = t.data.clone()
    return pipe


def _posterior(vae, pixel_values, latent_noise):
    """The VAE posterior sample `mean + std * latent_noise` (what `latent_dist.sample()` draws, with given noise)."""
    dist = vae.encode(pixel_values).latent_dist
    return dist.mean + dist.std * latent_noise


def sd_loss(unet, vae, text_encoder, scheduler, batch) -> torch.Tensor:
    """train_text_to_image.py: latents * scaling_factor, DDPM add_noise, epsilon (or v) target, MSE."""
    latents = _posterior(vae, batch["pixel_values"], batch["latent_noise"]) * vae.config.scaling_factor
    noise, timesteps = batch["noise"], batch["timesteps"]
    noisy = scheduler.add_noise(latents, noise, timesteps)
    encoder_hidden_states = text_encoder(batch["input_ids"], return_dict=False)[0]
    v_pred = scheduler.config.prediction_type == "v_prediction"
    target = scheduler.get_velocity(latents, noise, timesteps) if v_pred else noise
    pred = unet(noisy, timesteps, encoder_hidden_states, return_dict=False)[0]
    return F.mse_loss(pred.float(), target.float(), reduction="mean")


def flux_loss(transformer, vae, text_encoder, text_encoder_2, scheduler, batch, guidance_scale: float = 3.5):
    """train_dreambooth_flux.py with weighting_scheme="none": (x - shift) * scale latents, noisy =
    (1 - sigma) x0 + sigma noise, packed 2x2, target = noise - x0, timestep = sigma * num_train_timesteps / 1000."""
    x0 = _posterior(vae, batch["pixel_values"], batch["latent_noise"])
    x0 = (x0 - vae.config.shift_factor) * vae.config.scaling_factor
    b, c, h, w = x0.shape
    noise, sigmas = batch["noise"], batch["sigmas"].to(x0.dtype)
    timesteps = sigmas * scheduler.config.num_train_timesteps
    noisy = (1.0 - sigmas.view(b, 1, 1, 1)) * x0 + sigmas.view(b, 1, 1, 1) * noise
    pooled = text_encoder(batch["input_ids"], output_hidden_states=False).pooler_output
    prompt_embeds = text_encoder_2(batch["input_ids_2"], output_hidden_states=False)[0]
    text_ids = torch.zeros(prompt_embeds.shape[1], 3, dtype=x0.dtype)
    img_ids = FluxPipeline._prepare_latent_image_ids(b, h // 2, w // 2, x0.device, x0.dtype)
    guidance = torch.full((b,), guidance_scale, dtype=x0.dtype) if transformer.config.guidance_embeds else None
    pred = transformer(
        hidden_states=FluxPipeline._pack_latents(noisy, b, c, h, w), timestep=timesteps / 1000, guidance=guidance,
        pooled_projections=pooled, encoder_hidden_states=prompt_embeds, txt_ids=text_ids, img_ids=img_ids,
        return_dict=False)[0]
    scale = 2 ** (len(vae.config.block_out_channels) - 1)  # the pipeline's vae_scale_factor
    pred = FluxPipeline._unpack_latents(pred, h * scale, w * scale, scale)
    return ((pred.float() - (noise - x0).float()) ** 2).reshape(b, -1).mean(1).mean()


def wan_loss(transformer, vae, text_encoder, scheduler, batch) -> torch.Tensor:
    """Flow matching on Wan's normalised latents ((x - latents_mean) / latents_std, the inverse of the pipeline's
    decode), its prompt embeddings (the T5 states, zero past each prompt's length, as `_get_t5_prompt_embeds`),
    timestep = sigma * num_train_timesteps, target = noise - x0."""
    dist = vae.encode(batch["video"]).latent_dist
    x0 = dist.mean + dist.std * batch["latent_noise"]
    shape = (1, vae.config.z_dim, 1, 1, 1)
    mean, std = (torch.tensor(vae.config[k]).view(shape).to(x0) for k in ("latents_mean", "latents_std"))
    x0 = (x0 - mean) / std
    mask = batch["input_ids"] != 0  # T5's padding id
    prompt_embeds = text_encoder(batch["input_ids"], attention_mask=mask.long()).last_hidden_state * mask[..., None]
    sigmas = batch["sigmas"].to(x0.dtype).view(-1, 1, 1, 1, 1)
    noise = batch["noise"]
    noisy = (1.0 - sigmas) * x0 + sigmas * noise
    timestep = sigmas.flatten() * scheduler.config.num_train_timesteps
    pred = transformer(hidden_states=noisy, timestep=timestep, encoder_hidden_states=prompt_embeds,
                       return_dict=False)[0]
    return ((pred.float() - (noise - x0).float()) ** 2).reshape(pred.shape[0], -1).mean(1).mean()


def _ids(tok, text: str) -> torch.Tensor:  # padded to MAX_LEN like the pipelines do
    return tok(text, padding="max_length", max_length=MAX_LEN, truncation=True, return_tensors="pt").input_ids[0]


def _common_rows(n: int, g: torch.Generator, tok) -> list[dict]:
    return [{
        "pixel_values": torch.rand(3, IMAGE, IMAGE, generator=g) * 2 - 1,
        "input_ids": _ids(tok, CAPTIONS[i % len(CAPTIONS)]),
        "latent_noise": torch.randn(4, LATENT, LATENT, generator=g),
        "noise": torch.randn(4, LATENT, LATENT, generator=g),
    } for i in range(n)]


def sd_rows(n: int, seed: int = 0) -> list[dict]:
    """n rows: pixel_values (3,16,16), input_ids (16,), latent_noise/noise (4,8,8), timesteps () in [0, 1000)."""
    rows = _common_rows(n, g := torch.Generator().manual_seed(seed), clip_tokenizer())
    for r in rows:
        r["timesteps"] = torch.randint(0, 1000, (), generator=g)
    return rows


def flux_rows(n: int, seed: int = 0) -> list[dict]:
    """sd_rows' columns but T5 `input_ids_2` (16,) and `sigmas` () uniform in [0.02, 0.98] instead of timesteps."""
    rows = _common_rows(n, g := torch.Generator().manual_seed(seed), clip_tokenizer())
    tok2 = t5_tokenizer()
    for i, r in enumerate(rows):
        r["input_ids_2"] = _ids(tok2, CAPTIONS[i % len(CAPTIONS)])
        r["sigmas"] = 0.02 + 0.96 * torch.rand((), generator=g)
    return rows


def wan_rows(n: int, seed: int = 0) -> list[dict]:
    """n rows: video (3, FRAMES, VIDEO, VIDEO) in [-1, 1], T5 input_ids (16,), latent_noise / noise (16, 3, 4, 4),
    sigmas () uniform in [0.02, 0.98]."""
    g, tok = torch.Generator().manual_seed(seed), t5_tokenizer()
    latent = (16, (FRAMES - 1) // 4 + 1, VIDEO // 8, VIDEO // 8)
    return [{"video": torch.rand(3, FRAMES, VIDEO, VIDEO, generator=g) * 2 - 1,
             "input_ids": _ids(tok, CAPTIONS[i % len(CAPTIONS)]),
             "latent_noise": torch.randn(*latent, generator=g), "noise": torch.randn(*latent, generator=g),
             "sigmas": 0.02 + 0.96 * torch.rand((), generator=g)} for i in range(n)]


def wan_modules(pipe) -> dict:
    return {k: getattr(pipe, k) for k in ("transformer", "vae", "text_encoder", "scheduler")}


def sd_modules(pipe) -> dict:  # the keyword arguments of sd_loss / flux_loss (less `batch`) from a pipeline
    return {k: getattr(pipe, k) for k in ("unet", "vae", "text_encoder", "scheduler")}


def flux_modules(pipe) -> dict:
    return {k: getattr(pipe, k) for k in ("transformer", "vae", "text_encoder", "text_encoder_2", "scheduler")}


def collate(rows: list[dict]) -> dict:  # stack each column
    return {k: torch.stack([r[k] for r in rows]) for k in rows[0]}


def reference_train(pipeline_modules: dict, loss_fn, rows, steps: int, batch_size: int, lrs: dict,
                    trainable: list) -> list[float]:
    """Hand-written loop: trains the given modules IN PLACE. Step s uses rows[s*bs : (s+1)*bs], wrapping around
    (index modulo len(rows)), no shuffle. One AdamW (weight_decay=0, other args default) per trainable module, in
    `trainable` order; each step: every zero_grad, loss_fn(**pipeline_modules, batch=...).backward(), every step.
    Frozen nn.Modules: requires_grad False, eval(); trained: requires_grad True, train(). Non-modules (scheduler)
    are passed through untouched."""
    for name, m in pipeline_modules.items():
        if isinstance(m, torch.nn.Module):
            m.requires_grad_(name in trainable)
            m.train(name in trainable)
    opts = [torch.optim.AdamW(pipeline_modules[n].parameters(), lr=lrs[n], weight_decay=0.0) for n in trainable]
    losses = []
    for s in range(steps):
        batch = collate([rows[(s * batch_size + i) % len(rows)] for i in range(batch_size)])
        for o in opts:
            o.zero_grad()
        loss = loss_fn(**pipeline_modules, batch=batch)
        loss.backward()
        for o in opts:
            o.step()
        losses.append(float(loss.detach()))
    return losses
