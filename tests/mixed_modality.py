"""A LLaVA-style captioner whose samples may lack an image, for batches where a modality is missing on some ranks.

Each sample is 17 prefix slots (the image's 17 ViT tokens scattered in, or padding for a text-only sample; no loss
on them) then the caption, so every sample has the same number of labelled tokens. `HAS_IMAGE` lays out 4 steps
of 4 ranks x 2 samples (accelerate gives rank r of step k the samples 8k + 2r, 8k + 2r + 1): ranks 0-1 have no
image at the very first step, nobody has one at step 2, only rank 1 at step 3, everyone at step 4.
"""

import torch
from helpers import tiny_data, tiny_model

from hf_omni import offline_encoder
from hf_omni.testing.digits import Captioner

SLOTS = 17  # ViT tokens per 8x8 image (16 patches of 2x2 + CLS)
STEPS = [[False, False, True, True], [False, False, False, False], [False, True, False, False], [True] * 4]
HAS_IMAGE = [image for step in STEPS for image in step for _ in range(2)]
# 4 ranks x 1 sample x 2 micro-steps (rank r of micro-step m of step k: sample 8k + 4m + r): step 3 has an image on
# rank 2 only in its first micro-step, none anywhere in its last (the window must still close with a sync)
ACCUMULATION = [False] * 4 + [True] * 4 + [False] * 8 + [False, False, True] + [False] * 5 + [True] * 8


class MixedCaptioner(Captioner):
    """The image features replace the image slots of `input_ids` (`masked_scatter`, as LLaVA-style VLMs do)."""

    def forward(self, input_ids, pixel_values=None, image_features=None, labels=None, **kw):
        embeds = self.llm.get_input_embeddings()(input_ids)
        feats = image_features if image_features is not None else self.encode_image(pixel_values)
        if feats is not None:  # None: no rank has an image this step; 0 rows: this rank has none
            slots = (input_ids == self.processors["llm"].unk_token_id).unsqueeze(-1)
            embeds = embeds.masked_scatter(slots, self.projector(feats).to(embeds.dtype))
        return self.llm(inputs_embeds=embeds, labels=labels, **kw)


class DroppingCaptioner(MixedCaptioner):
    """The entry point runs vision and projector; `forward` drops 0 rows and returns a tuple: the 0 rows reach the
    loss only through hf_omni's forward hook."""

    @offline_encoder(module="vision", inputs=["pixel_values"], output="image_features")
    def encode_image(self, pixel_values):
        return self.projector(self.vision(pixel_values=pixel_values).last_hidden_state)

    def forward(self, input_ids, pixel_values=None, labels=None, **kw):
        embeds = self.llm.get_input_embeddings()(input_ids)
        feats = self.encode_image(pixel_values)
        if feats is not None and len(feats):
            slots = (input_ids == self.processors["llm"].unk_token_id).unsqueeze(-1)
            embeds = embeds.masked_scatter(slots, feats.to(embeds.dtype))
        return self.llm(inputs_embeds=embeds, labels=labels, **kw).to_tuple()


class TokenImageCaptioner(MixedCaptioner):
    """Its vision module a Llama reading each image as 17 tokens (`image_tokens`), as VQ-token VLMs read images: a
    module with a tensor-parallel plan that some ranks have no input for."""

    @offline_encoder(module="vision", inputs=["image_ids"], output="image_features")
    def encode_image(self, image_ids):
        return self.vision(input_ids=image_ids).last_hidden_state

    def forward(self, input_ids, image_ids=None, labels=None, **kw):
        return super().forward(input_ids, pixel_values=image_ids, labels=labels, **kw)


def image_tokens(pixel_values: torch.Tensor) -> torch.Tensor:
    """A (C, 8, 8) image as 17 token ids: 0 (a start token), then its 4 x 4 mean-pooled grey levels in 16 bins."""
    pooled = torch.nn.functional.avg_pool2d(pixel_values.mean(0, keepdim=True), 2).flatten()
    bins = torch.bucketize(pooled, torch.linspace(float(pooled.min()), float(pooled.max()) + 1e-6, 17)[1:-1])
    return torch.cat([torch.zeros(1, dtype=torch.long), bins + 1])


def token_image_model(moe: bool = False) -> TokenImageCaptioner:
    """`moe`: the image-token reader a Qwen2-MoE (4 fused experts, top 2) instead of a Llama."""
    from transformers import LlamaConfig, LlamaModel, Qwen2MoeConfig, Qwen2MoeModel

    base = tiny_model()
    modules = base.omni_modules()
    torch.manual_seed(0)
    shape = dict(vocab_size=20, hidden_size=32, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2)
    modules["vision"] = Qwen2MoeModel(Qwen2MoeConfig(
        **shape, intermediate_size=64, moe_intermediate_size=16, shared_expert_intermediate_size=32, num_experts=4,
        num_experts_per_tok=2)) if moe else LlamaModel(LlamaConfig(**shape, intermediate_size=64))
    return TokenImageCaptioner.from_modules(modules, processors=base.processors)


class TokenImageCaptions(torch.utils.data.Dataset):
    """`MixedCaptions` with each image as its `image_tokens`."""

    def __init__(self, model):
        self.rows = MixedCaptions(model)

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        item = dict(self.rows[i])
        if "pixel_values" in item:
            item["image_ids"] = image_tokens(item.pop("pixel_values"))
        return item


def mixed_model(cls=MixedCaptioner) -> MixedCaptioner:
    base = tiny_model()
    return cls.from_modules(base.omni_modules(), processors=base.processors)


class MixedCaptions(torch.utils.data.Dataset):
    def __init__(self, model, has_image: list[bool] = HAS_IMAGE):
        self.base, self.has_image = tiny_data(model, len(has_image)), has_image
        self.image, self.pad = model.processors["llm"].unk_token_id, model.processors["llm"].pad_token_id

    def __len__(self):
        return len(self.has_image)

    def __getitem__(self, i):
        row, image = self.base[i], self.has_image[i]
        item = {"input_ids": torch.cat([torch.full((SLOTS,), self.image if image else self.pad), row["input_ids"]]),
                "labels": torch.cat([torch.full((SLOTS,), -100), row["labels"]])}
        return item | ({"pixel_values": row["pixel_values"]} if image else {})


def collate(items: list[dict]) -> dict:
    """Each key stacked over the samples that have it (a batch without images has no `pixel_values`)."""
    keys = dict.fromkeys(k for item in items for k in item)
    return {k: torch.stack([item[k] for item in items if k in item]) for k in keys}
