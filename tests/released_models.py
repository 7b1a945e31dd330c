"""Tiny released composite models (built from configs: nothing downloads), their `modules=` mappings, and image +
text rows in each family's own input format."""

from __future__ import annotations

import torch
from transformers import (
    Blip2Config, Blip2ForConditionalGeneration, CLIPVisionConfig, Gemma3Config, Gemma3ForConditionalGeneration,
    LlamaConfig, LlavaConfig, LlavaForConditionalGeneration, PaliGemmaConfig, PaliGemmaForConditionalGeneration,
    Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration,
)

IMAGE_TOKENS = 4  # every family here: 4 image tokens per image


def llava(seed: int = 0) -> LlavaForConditionalGeneration:
    vision = CLIPVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                              image_size=8, patch_size=4, projection_dim=16)
    text = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                       num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64)
    config = LlavaConfig(vision_config=vision, text_config=text, image_token_index=63, vision_feature_layer=-1,
                         vision_feature_select_strategy="default", image_seq_length=IMAGE_TOKENS)
    torch.manual_seed(seed)
    return LlavaForConditionalGeneration(config)


def qwen2_5_vl(seed: int = 0) -> Qwen2_5_VLForConditionalGeneration:
    vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, in_channels=3, patch_size=2,
                  spatial_merge_size=2, temporal_patch_size=1, out_hidden_size=24, window_size=8,
                  fullatt_block_indexes=[1])
    text = dict(vocab_size=80, hidden_size=24, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2,
                num_key_value_heads=1, max_position_embeddings=128, bos_token_id=0, eos_token_id=1,
                rope_scaling={"type": "mrope", "mrope_section": [2, 2, 2]})
    config = Qwen2_5_VLConfig(vision_config=vision, text_config=text, image_token_id=70, video_token_id=71,
                              vision_start_token_id=72, bos_token_id=0, eos_token_id=1)
    torch.manual_seed(seed)
    return Qwen2_5_VLForConditionalGeneration(config)


def paligemma(seed: int = 0) -> PaliGemmaForConditionalGeneration:
    vision = dict(model_type="siglip_vision_model", hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                  num_attention_heads=2, image_size=8, patch_size=4, projection_dim=16)
    text = dict(model_type="gemma", vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                num_attention_heads=2, num_key_value_heads=1, head_dim=8, max_position_embeddings=64)
    config = PaliGemmaConfig(vision_config=vision, text_config=text, image_token_index=63, projection_dim=16)
    torch.manual_seed(seed)
    return PaliGemmaForConditionalGeneration(config)


def blip2(seed: int = 0) -> Blip2ForConditionalGeneration:
    """BLIP-2 with an OPT language model; its `query_tokens` a parameter of the root model itself."""
    vision = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2, image_size=8,
                  patch_size=4)
    qformer = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                   encoder_hidden_size=16, vocab_size=64, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    text = dict(model_type="opt", vocab_size=64, hidden_size=16, ffn_dim=32, num_hidden_layers=2,
                num_attention_heads=2, max_position_embeddings=64, word_embed_proj_dim=16, dropout=0.0)
    config = Blip2Config(vision_config=vision, qformer_config=qformer, text_config=text, num_query_tokens=IMAGE_TOKENS,
                         image_token_index=63)
    torch.manual_seed(seed)
    return Blip2ForConditionalGeneration(config)


def gemma3(seed: int = 0) -> Gemma3ForConditionalGeneration:
    """Gemma3: its `lm_head` (tied to the language model's embeddings) outside `model.language_model`."""
    vision = dict(model_type="siglip_vision_model", hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                  num_attention_heads=2, image_size=8, patch_size=2)
    text = dict(model_type="gemma3_text", vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                num_attention_heads=2, num_key_value_heads=1, head_dim=8, max_position_embeddings=64,
                sliding_window=8)
    config = Gemma3Config(vision_config=vision, text_config=text, mm_tokens_per_image=IMAGE_TOKENS,
                          image_token_index=63, boi_token_index=61, eoi_token_index=62)
    torch.manual_seed(seed)
    return Gemma3ForConditionalGeneration(config)


MODULES = {
    "llava": {"vision": "model.vision_tower", "projector": "model.multi_modal_projector",
              "llm": ["model.language_model", "lm_head"]},
    "qwen2_5_vl": {"vision": "model.visual", "projector": "model.visual.merger",
                   "llm": ["model.language_model", "lm_head"]},
    "paligemma": {"vision": "model.vision_tower", "projector": "model.multi_modal_projector",
                  "llm": ["model.language_model", "lm_head"]},
    "blip2": {"vision": "vision_model", "qformer": ["qformer", "query_tokens", "language_projection"],
              "llm": "language_model"},
}
BUILDERS = {"llava": llava, "qwen2_5_vl": qwen2_5_vl, "paligemma": paligemma, "blip2": blip2}
BUILT = BUILDERS | {"gemma3": gemma3}  # every family here (Gemma3 outside the module matrix: its mapping below)
TIED_OUTSIDE = {"vision": "model.vision_tower", "projector": "model.multi_modal_projector",
                "llm": "model.language_model"}  # Gemma3's: its tied `lm_head` taken into `llm`


def image_prefix(family: str, model, wide: bool = False) -> list[int]:
    """The tokens standing for one image in the text, as the family's processor writes them."""
    if family == "qwen2_5_vl":
        return [model.config.vision_start_token_id] + [model.config.image_token_id] * IMAGE_TOKENS * (2 if wide else 1)
    if family == "blip2":
        return [model.config.image_token_id] * IMAGE_TOKENS
    return [model.config.image_token_index] * IMAGE_TOKENS


def pixels(family: str, generator, wide: bool = False) -> dict[str, torch.Tensor]:
    """One image in the family's input format: LLaVA / PaliGemma a 3x8x8 image; Qwen2.5-VL its 16 flattened 2x2
    patches (4x4 grid) and the grid, `wide`: 32 patches (a 4x8 grid, twice the image tokens)."""
    if family == "qwen2_5_vl":
        width = 8 if wide else 4
        return {"pixel_values": torch.randn(4 * width, 12, generator=generator),
                "image_grid_thw": torch.tensor([1, 4, width])}
    return {"pixel_values": torch.randn(3, 8, 8, generator=generator)}


class Rows(torch.utils.data.Dataset):
    """`n` rows of one image and 6 text tokens (labels: the text; -100 under the image tokens); `text_only`: every
    k-th row has no image (`modalities` says which rows do)."""

    def __init__(self, family: str, model, n: int, seed: int = 0, text_only_every: int = 0, wide_every: int = 0,
                 mrope: bool = False):
        generator = torch.Generator().manual_seed(seed)
        vocab = model.config.get_text_config().vocab_size
        self.rows = []
        for i in range(n):
            text = torch.randint(2, 60, (6,), generator=generator).tolist()
            wide = bool(wide_every) and i % wide_every == 1  # Qwen2.5-VL: mixed resolutions
            image = pixels(family, generator, wide)
            if text_only_every and i % text_only_every == 0:
                self.rows.append({"input_ids": torch.tensor(text), "labels": torch.tensor(text)})
                continue
            prefix = image_prefix(family, model, wide)
            assert max(prefix) < vocab
            row = {"input_ids": torch.tensor(prefix + text), "labels": torch.tensor([-100] * len(prefix) + text),
                   **image}
            if mrope:  # Qwen2.5-VL's processor's token types (1: an image token): the model's 3-D rotary positions
                row["mm_token_type_ids"] = (row["input_ids"] == model.config.image_token_id).long()
            self.rows.append(row)
        self.modalities = [["image"] if "pixel_values" in row else [] for row in self.rows]

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return self.rows[i]


def collate(rows: list[dict]) -> dict[str, torch.Tensor]:
    """Text padded on the left (pad 0, labels -100, attention mask 0); LLaVA / PaliGemma images stacked,
    Qwen2.5-VL's patches concatenated with one grid row per image."""
    batch = images_of(rows)
    if "input_ids" not in rows[0]:  # an offline encoder's batch: its inputs only
        return batch
    width = max(len(r["input_ids"]) for r in rows)
    batch |= {"input_ids": torch.zeros(len(rows), width, dtype=torch.long),
              "labels": torch.full((len(rows), width), -100, dtype=torch.long),
              "attention_mask": torch.zeros(len(rows), width, dtype=torch.long)}
    if "mm_token_type_ids" in rows[0]:
        batch["mm_token_type_ids"] = torch.zeros(len(rows), width, dtype=torch.long)
    for i, row in enumerate(rows):
        n = len(row["input_ids"])
        batch["input_ids"][i, width - n:] = row["input_ids"]
        batch["labels"][i, width - n:] = row["labels"]
        batch["attention_mask"][i, width - n:] = 1
        if "mm_token_type_ids" in batch:
            batch["mm_token_type_ids"][i, width - n:] = row["mm_token_type_ids"]
    return batch


def images_of(rows: list[dict]) -> dict[str, torch.Tensor]:
    """The rows' images; Qwen2.5-VL's grids also for rows served from an offline cache (their pixels dropped)."""
    batch = {}
    images = [r for r in rows if "pixel_values" in r]
    if images and "image_grid_thw" in images[0]:
        batch["pixel_values"] = torch.cat([r["pixel_values"] for r in images])
    elif images:
        batch["pixel_values"] = torch.stack([r["pixel_values"] for r in images])
    grids = [r["image_grid_thw"] for r in rows if "image_grid_thw" in r]
    if grids:
        batch["image_grid_thw"] = torch.stack(grids)
    return batch
