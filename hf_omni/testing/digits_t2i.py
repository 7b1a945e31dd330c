"""A tiny pixel-space text-to-image model that draws handwritten digits (examples/text_to_image.py's pieces).

The pipeline is DeepFloyd-IF-style `IFPipeline`: frozen random T5 encoder + UNet2DConditionModel + DDPM; beside it
the digits, prompts and classifier score of the demo.

Why pixel space: the digits are 8x8 grey images, so a UNet can denoise the pixels themselves; a latent pipeline
would first need a VAE trained on them, another stage and another source of error. `IFPipeline` is diffusers'
pixel-space text-to-image pipeline (T5 prompts, classifier-free guidance against the empty prompt).
Everything is built from configs with seeded weights and an in-code tokenizer: no download.
Data: `sklearn.datasets.load_digits` (1,797 8x8 scans, 0..16), split half/half stratified: the model trains on one
half; the scorer (logistic regression) is fit on the other, which the model never sees.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from diffusers import DDPMScheduler, IFPipeline, UNet2DConditionModel
from transformers import T5Config, T5EncoderModel, T5Tokenizer

from ..modeling import OmniModel

SIDE = 8  # load_digits' own resolution; the UNet works at 8x8 and 4x4
TEXT_DIM = 32  # T5 d_model = UNet cross_attention_dim
WORDS = ["a", "handwritten", *"0123456789"]


def prompt(digit: int) -> str:
    return f"a handwritten {digit}"


def t5_tokenizer() -> T5Tokenizer:
    """Unigram (SentencePiece-style `▁` word prefix): each prompt word one piece, letters and digits as fallback.
    ids: 0 <pad>, 1 </s>, 2 <unk>."""
    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("▁", -2.0)]
    pieces += [("▁" + w, -1.0) for w in WORDS]
    pieces += [(c, -5.0) for c in "abcdefghijklmnopqrstuvwxyz0123456789"]
    return T5Tokenizer(vocab=pieces, extra_ids=0, model_max_length=77)


def build_pipeline(seed: int = 0, channels: tuple = (32, 32), text_layers: int = 2) -> IFPipeline:
    """T5 encoder (frozen in the demo: its random embeddings of "0".."9" already differ) + a UNet over 1-channel
    8x8 pixels. `out_channels` is twice `in_channels`: IFPipeline splits off a predicted variance, which the
    scheduler's `fixed_small` variance ignores."""
    tok = t5_tokenizer()
    torch.manual_seed(seed)
    t5 = T5EncoderModel(T5Config(
        vocab_size=len(tok), d_model=TEXT_DIM, d_kv=8, d_ff=64, num_layers=text_layers, num_heads=4,
        relative_attention_num_buckets=8, dropout_rate=0.0, feed_forward_proj="gated-gelu",
        pad_token_id=0, eos_token_id=1, decoder_start_token_id=0)).eval()
    unet = UNet2DConditionModel(  # cross-attention (to the prompt only) at 4x4, none at 8x8: cheaper
        sample_size=SIDE, in_channels=1, out_channels=2, layers_per_block=1, block_out_channels=channels,
        down_block_types=("DownBlock2D",) + ("CrossAttnDownBlock2D",) * (len(channels) - 1),
        up_block_types=("CrossAttnUpBlock2D",) * (len(channels) - 1) + ("UpBlock2D",), only_cross_attention=True,
        cross_attention_dim=TEXT_DIM, attention_head_dim=8, norm_num_groups=8).eval()
    scheduler = DDPMScheduler(num_train_timesteps=1000, beta_schedule="squaredcos_cap_v2", prediction_type="epsilon",
                              variance_type="fixed_small", clip_sample=True)
    return IFPipeline(tokenizer=tok, text_encoder=t5, unet=unet, scheduler=scheduler, safety_checker=None,
                      feature_extractor=None, watermarker=None, requires_safety_checker=False)


class DigitT2I(OmniModel):
    """The training loss of a text-conditioned epsilon-prediction DDPM (diffusers' train_text_to_image.py without
    the VAE), with the prompt replaced by the empty prompt for a `p_uncond` share of rows so that the pipeline's
    classifier-free guidance has an unconditional prediction to guide against."""

    p_uncond = 0.1

    def forward(self, pixel_values, input_ids, attention_mask, empty_ids, empty_mask):
        drop = (torch.rand(len(input_ids), device=input_ids.device) < self.p_uncond)[:, None]
        ids, mask = torch.where(drop, empty_ids, input_ids), torch.where(drop, empty_mask, attention_mask)
        # the batch holds at most 11 distinct prompts: encode each once (the same states, a fraction of the cost)
        unique, inverse = torch.unique(torch.cat([ids, mask], dim=1), dim=0, return_inverse=True)
        width = ids.shape[1]
        states = self.text_encoder(unique[:, :width], attention_mask=unique[:, width:], return_dict=False)[0][inverse]
        noise = torch.randn_like(pixel_values)
        steps = torch.randint(0, self.scheduler.config.num_train_timesteps, (len(pixel_values),),
                              device=pixel_values.device)
        noisy = self.scheduler.add_noise(pixel_values, noise, steps)
        pred = self.unet(noisy, steps, states, return_dict=False)[0][:, :pixel_values.shape[1]]
        return {"loss": F.mse_loss(pred.float(), noise.float())}


def load_splits(seed: int = 0):
    """(train_x, train_y), (held_x, held_y): load_digits halved, stratified, fixed seed; x in 0..16, shape (n, 64)."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    d = load_digits()
    xt, xh, yt, yh = train_test_split(d.data, d.target, test_size=0.5, random_state=seed, stratify=d.target)
    return (xt, yt), (xh, yh)


class DigitPrompts(torch.utils.data.Dataset):
    """Rows as IFPipeline encodes prompts: T5 ids padded to 77 with their mask; pixels in [-1, 1], (1, 8, 8)."""

    def __init__(self, images: np.ndarray, targets: np.ndarray, tokenizer: T5Tokenizer):
        self.pixels = torch.tensor(images, dtype=torch.float32).view(-1, 1, SIDE, SIDE) / 8.0 - 1.0
        enc = tokenizer([prompt(int(t)) for t in targets], padding="max_length", max_length=77, return_tensors="pt")
        empty = tokenizer([""], padding="max_length", max_length=77, return_tensors="pt")
        self.ids, self.mask = enc.input_ids, enc.attention_mask
        self.empty_ids, self.empty_mask = empty.input_ids[0], empty.attention_mask[0]

    def __len__(self):
        return len(self.pixels)

    def __getitem__(self, i):
        return {"pixel_values": self.pixels[i], "input_ids": self.ids[i], "attention_mask": self.mask[i],
                "empty_ids": self.empty_ids, "empty_mask": self.empty_mask}


def fit_scorer(held_x: np.ndarray, held_y: np.ndarray):
    """Logistic regression on the held-out half (pixels / 16): the judge of what a generated image shows."""
    from sklearn.linear_model import LogisticRegression

    return LogisticRegression(max_iter=2000).fit(held_x / 16.0, held_y)


def score(classifier, images: np.ndarray, digits: np.ndarray) -> float:
    """Share of images (n, 8, 8[, 1]) in [0, 1] that the classifier reads as the digit they were prompted with."""
    flat = np.asarray(images, dtype=np.float64).reshape(len(images), -1)
    return float((classifier.predict(flat) == np.asarray(digits)).mean())


@torch.no_grad()
def generate(pipe: IFPipeline, per_digit: int = 10, steps: int = 50, guidance: float = 3.0, seed: int = 0):
    """`per_digit` images of each digit 0..9 from one seeded generator: (images (n, 8, 8) in [0, 1], digits (n,))."""
    digits = np.repeat(np.arange(10), per_digit)
    out = pipe([prompt(int(d)) for d in digits], num_inference_steps=steps, guidance_scale=guidance,
               generator=torch.Generator().manual_seed(seed), output_type="np", clean_caption=False)
    return np.asarray(out.images)[..., 0], digits


def grid(images: np.ndarray, per_row: int, scale: int = 4):
    """A PIL image: the (n, 8, 8) images in rows of `per_row`, each pixel `scale` x `scale`, 1-pixel gaps."""
    from PIL import Image

    n, h, w = images.shape
    rows = -(-n // per_row)
    canvas = np.ones((rows * (h + 1) + 1, per_row * (w + 1) + 1))
    for i, im in enumerate(images):
        r, c = divmod(i, per_row)
        canvas[1 + r * (h + 1):1 + r * (h + 1) + h, 1 + c * (w + 1):1 + c * (w + 1) + w] = im
    big = np.kron(canvas, np.ones((scale, scale)))
    return Image.fromarray((big * 255).round().clip(0, 255).astype(np.uint8), mode="L")
