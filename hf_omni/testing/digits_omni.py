"""One model that reads and draws handwritten digits (examples/read_and_draw.py's pieces): the unified-model pattern
of an LLM whose states also condition a diffusion decoder.

    vision (ViT) -> projector -> llm (Llama-style)  -> "this is a handwritten digit seven"     (reading)
    "draw a handwritten digit seven" -> llm -> connector -> unet (8x8 pixels, DDPM)  -> a 7   (drawing)
                                  (its states at the prompt's last two tokens)

Every row of a batch is used both ways: its image is captioned, and drawn from the prompt of its digit, so each
batch mixes both tasks and every module runs on every rank at every step (no rank lacks a task). The LLM learns
from both losses (the decoder's through the connector). Data: `sklearn.datasets.load_digits`, halved and
stratified: the model trains on one half; captions are scored on the other half, and drawings by a logistic
regression fit on it (`digits_t2i.fit_scorer`). Built from configs with seeded weights: no download.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from diffusers import DDPMScheduler, UNet2DConditionModel
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast, ViTConfig, ViTModel

from ..modeling import OmniModel
from ..offline.encoder import offline_encoder
from ..projector import Projector, ProjectorConfig
from .digits import DIGITS, PROMPT, SPECIAL

VOCAB = SPECIAL + PROMPT + DIGITS + ["draw"]
CAPTION = PROMPT  # "this is a handwritten digit <name>"
DRAW = ["draw", "a", "handwritten", "digit"]  # "draw a handwritten digit <name>"
WIDTH = 8  # [BOS] + 5 words + digit + [EOS]; a drawing prompt padded to it
SCHEDULE = dict(num_train_timesteps=1000, beta_schedule="squaredcos_cap_v2", prediction_type="epsilon",
                variance_type="fixed_small", clip_sample=True)


class ReadAndDraw(OmniModel):
    """The captioner's forward and a text-conditioned DDPM's training loss in one step; the prompt is replaced by
    the empty one for a `p_uncond` share of rows (classifier-free guidance needs an unconditional prediction)."""

    p_uncond = 0.1

    def loss_modules(self) -> dict[str, str]:
        return {"caption": "llm", "draw": "unet"}

    @offline_encoder(module="vision", inputs=["pixel_values"], output="image_features")
    def encode_image(self, pixel_values):
        return self.vision(pixel_values=pixel_values).last_hidden_state

    def read(self, input_ids, pixel_values=None, image_features=None, labels=None):
        """The captioner: image patches -> projector -> LM prefix, the caption after it."""
        feats = image_features if image_features is not None else self.encode_image(pixel_values)
        prefix = self.projector(feats)
        embeds = torch.cat([prefix, self.llm.get_input_embeddings()(input_ids)], dim=1)
        if labels is not None:
            labels = torch.cat([labels.new_full(prefix.shape[:2], -100), labels], dim=1)
        return self.llm(inputs_embeds=embeds, labels=labels)

    def prompt_states(self, ids, mask):
        """The LLM's last states at a drawing prompt's last two tokens (its digit and its end), through the
        connector: the decoder's conditioning. (Conditioned on every position instead, where the tokens before the
        digit are the same for every prompt, the decoder learned to ignore the prompt: 8-25% of drawings read as
        prompted after 400 steps, against 93% so.)"""
        out = self.llm(input_ids=ids, attention_mask=mask, output_hidden_states=True)  # the LLM's own forward
        ends = mask.sum(-1, keepdim=True) + torch.tensor([-2, -1], device=mask.device)
        last = out.hidden_states[-1].gather(1, ends[..., None].expand(-1, -1, out.hidden_states[-1].shape[-1]))
        return self.connector(last)

    def forward(self, input_ids, labels, draw_ids, draw_mask, empty_ids, empty_mask, draw_pixels,
                pixel_values=None, image_features=None):
        caption = self.read(input_ids, pixel_values, image_features, labels).loss
        drop = (torch.rand(len(draw_ids), device=draw_ids.device) < self.p_uncond)[:, None]
        ids, mask = torch.where(drop, empty_ids, draw_ids), torch.where(drop, empty_mask, draw_mask)
        states = self.prompt_states(ids, mask)
        target = draw_pixels
        noise = torch.randn_like(target)
        steps = torch.randint(0, SCHEDULE["num_train_timesteps"], (len(target),), device=target.device)
        noisy = noise_schedule().add_noise(target, noise, steps)
        pred = self.unet(noisy, steps, states, return_dict=False)[0]
        draw = F.mse_loss(pred.float(), noise.float())
        return {"loss": caption + draw, "losses": {"caption": caption.detach(), "draw": draw.detach()}}


def noise_schedule() -> DDPMScheduler:
    return DDPMScheduler(**SCHEDULE)


def build_tokenizer() -> PreTrainedTokenizerFast:
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(VOCAB)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="[PAD]", unk_token="[UNK]", bos_token="[BOS]",
                                   eos_token="[EOS]")


def build_model(seed: int = 0, hidden: int = 64, llm_hidden: int = 64, cond: int = 32,
                channels: tuple = (32, 32)) -> ReadAndDraw:
    """ViT (2 layers, 2x2 patches) + projector + Llama (2 layers) + connector + UNet over 1-channel 8x8 pixels
    with cross-attention at 4x4 (the digits_t2i denoiser, conditioned on the LLM instead of T5)."""
    torch.manual_seed(seed)
    tokenizer = build_tokenizer()
    vit = ViTModel(ViTConfig(hidden_size=hidden, num_hidden_layers=2, num_attention_heads=4,
                             intermediate_size=4 * hidden, image_size=8, patch_size=2, num_channels=1),
                   add_pooling_layer=False)
    projector = Projector(ProjectorConfig(in_features=hidden, out_features=llm_hidden, hidden_size=llm_hidden))
    llm = LlamaForCausalLM(LlamaConfig(
        hidden_size=llm_hidden, intermediate_size=4 * llm_hidden, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, vocab_size=len(VOCAB), max_position_embeddings=64,
        pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, tie_word_embeddings=False))
    connector = Projector(ProjectorConfig(in_features=llm_hidden, out_features=cond, hidden_size=llm_hidden,
                                          initializer_range=llm_hidden ** -0.5))  # outputs near unit scale from the
    # start, as the T5 states the same decoder learns from in digits_t2i
    unet = UNet2DConditionModel(
        sample_size=8, in_channels=1, out_channels=1, layers_per_block=1, block_out_channels=channels,
        down_block_types=("DownBlock2D",) + ("CrossAttnDownBlock2D",) * (len(channels) - 1),
        up_block_types=("CrossAttnUpBlock2D",) * (len(channels) - 1) + ("UpBlock2D",), only_cross_attention=True,
        cross_attention_dim=cond, attention_head_dim=8, norm_num_groups=8)
    return ReadAndDraw.from_modules({"vision": vit, "projector": projector, "llm": llm, "connector": connector,
                                     "unet": unet}, processors={"llm": tokenizer})


def encode(tokenizer, words: list[str]) -> list[int]:
    ids = tokenizer.convert_tokens_to_ids(["[BOS]"] + words + ["[EOS]"])
    return ids + [tokenizer.pad_token_id] * (WIDTH - len(ids))


class DigitsReadDraw(torch.utils.data.Dataset):
    """Each row: the image (pixels in [0, 1], (1, 8, 8)) and its caption (input_ids = labels) to read; the same
    image in [-1, 1] (`draw_pixels`) to draw from the prompt of its digit, and the empty prompt (each prompt padded
    to 8 with its mask)."""

    def __init__(self, images: np.ndarray, targets: np.ndarray, tokenizer):
        self.pixels = torch.tensor(images, dtype=torch.float32).view(-1, 1, 8, 8) / 16.0
        self.targets = torch.tensor(targets, dtype=torch.long)
        self.captions = torch.tensor([encode(tokenizer, CAPTION + [DIGITS[t]]) for t in targets])
        self.prompts = torch.tensor([encode(tokenizer, DRAW + [DIGITS[t]]) for t in targets])
        self.empty = torch.tensor(encode(tokenizer, []))
        self.pad = tokenizer.pad_token_id

    def __len__(self):
        return len(self.targets)

    def __getitem__(self, i):
        return {"pixel_values": self.pixels[i], "input_ids": self.captions[i], "labels": self.captions[i],
                "draw_pixels": self.pixels[i] * 2.0 - 1.0,
                "draw_ids": self.prompts[i], "draw_mask": (self.prompts[i] != self.pad).long(),
                "empty_ids": self.empty, "empty_mask": (self.empty != self.pad).long()}


@torch.no_grad()
def caption_accuracy(model: ReadAndDraw, data: DigitsReadDraw, batch_size: int = 512) -> float:
    """Greedy captions from [BOS] for every image; the share equal to the reference caption."""
    was = model.training
    model.eval()
    device = next(model.parameters()).device
    correct = 0
    for start in range(0, len(data), batch_size):
        pixels = data.pixels[start:start + batch_size].to(device)
        reference = data.captions[start:start + batch_size]
        ids = reference[:, :1].to(device)
        for _ in range(WIDTH - 1):
            ids = torch.cat([ids, model.read(ids, pixels).logits[:, -1:].argmax(-1)], dim=1)
        correct += (ids.cpu() == reference).all(dim=1).sum().item()
    model.train(was)
    return correct / len(data)


@torch.no_grad()
def draw(model: ReadAndDraw, digits: np.ndarray, tokenizer, steps: int = 50, guidance: float = 3.0,
         seed: int = 0) -> np.ndarray:
    """Images (n, 8, 8) in [0, 1] of the prompted digits: DDPM from one seeded generator, classifier-free guidance
    against the empty prompt."""
    was = model.training
    model.eval()
    device = next(model.parameters()).device
    prompts = torch.tensor([encode(tokenizer, DRAW + [DIGITS[int(d)]]) for d in digits], device=device)
    empty = torch.tensor([encode(tokenizer, [])] * len(digits), device=device)
    ids = torch.cat([prompts, empty])
    mask = (ids != tokenizer.pad_token_id).long()
    states = model.prompt_states(ids, mask)
    scheduler = noise_schedule()
    scheduler.set_timesteps(steps)
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn((len(digits), 1, 8, 8), generator=generator).to(device)
    for t in scheduler.timesteps:
        both = model.unet(torch.cat([x, x]), t, states, return_dict=False)[0]
        conditioned, unconditioned = both.chunk(2)
        eps = unconditioned + guidance * (conditioned - unconditioned)
        x = scheduler.step(eps, t, x, generator=generator).prev_sample
    model.train(was)
    return ((x[:, 0] + 1.0) / 2.0).clamp(0, 1).cpu().numpy()
