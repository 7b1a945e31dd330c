"""Tiny released omni models (built from their config classes: nothing downloads), their `modules=` mappings, and
rows of text, image and audio prompts with text replies and speech codes (synthetic codes: a real run takes them
from the release's speech tokenizer)."""

from __future__ import annotations

import torch
from transformers import Qwen2_5OmniConfig, Qwen2_5OmniForConditionalGeneration

AUDIO, IMAGE, VIDEO, AUDIO_START, AUDIO_END, VISION_START, VISION_END = 100, 101, 102, 103, 104, 105, 107
SPEAKER, TEXT_EOS, TEXT_PAD, REPLY_END = 113, 111, 112, 5  # the speaker's bos token; the reply's end-of-turn
CODEC_END = 125
QWEN2_5_OMNI = {"audio": "thinker.model.audio_tower", "vision": "thinker.model.visual",
                "llm": ["thinker.model.language_model", "thinker.lm_head"], "talker": "talker",
                "token2wav": "token2wav"}


def qwen2_5_omni(seed: int = 0) -> Qwen2_5OmniForConditionalGeneration:
    """Thinker (2-layer audio tower, 2-block vision tower, 2-layer LLM), talker (2 layers, 128 codes), token2wav
    (a 2-block DiT and a small BigVGAN), and one speaker."""
    rope = {"rope_type": "default", "rope_theta": 10000.0}
    vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, in_channels=3, patch_size=2,
                  spatial_merge_size=2, temporal_patch_size=1, out_hidden_size=24, window_size=8,
                  fullatt_block_indexes=[1])
    audio = dict(num_mel_bins=16, encoder_layers=2, encoder_attention_heads=2, encoder_ffn_dim=32, d_model=16,
                 max_source_positions=64, n_window=4, output_dim=24)
    text = dict(vocab_size=120, hidden_size=24, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2,
                num_key_value_heads=1, max_position_embeddings=256,
                rope_parameters={**rope, "mrope_section": [2, 2, 2]})
    tokens = dict(audio_token_index=AUDIO, image_token_index=IMAGE, video_token_index=VIDEO,
                  audio_start_token_id=AUDIO_START, audio_end_token_id=AUDIO_END, vision_start_token_id=VISION_START)
    thinker = dict(audio_config=audio, vision_config=vision, text_config=text, user_token_id=106, **tokens)
    talker = dict(vocab_size=128, tts_text_start_token_id=110, tts_text_end_token_id=TEXT_EOS,
                  tts_text_pad_token_id=TEXT_PAD, tts_codec_start_token_id=124, tts_codec_end_token_id=CODEC_END,
                  tts_codec_pad_token_id=126, tts_codec_mask_token_id=127, vision_end_token_id=VISION_END,
                  embedding_size=24, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                  num_key_value_heads=1, head_dim=8, max_position_embeddings=512,
                  rope_parameters={**rope, "mrope_section": [1, 1, 2]}, **tokens)
    dit = dict(hidden_size=16, num_hidden_layers=2, num_attention_heads=2, ff_mult=2, emb_dim=8, head_dim=8,
               num_embeds=128, mel_dim=8, enc_emb_dim=8, enc_dim=8, enc_channels=[8, 8, 8, 8, 24],
               enc_attention_channels=8, enc_se_channels=8, look_ahead_layers=[1], look_backward_layers=[0],
               block_size=4, repeats=2)
    bigvgan = dict(mel_dim=8, upsample_initial_channel=16, upsample_rates=[2, 2], upsample_kernel_sizes=[4, 4],
                   resblock_kernel_sizes=[3], resblock_dilation_sizes=[[1, 3, 5]])
    config = Qwen2_5OmniConfig(thinker_config=thinker, talker_config=talker, enable_audio_output=True,
                               token2wav_config=dict(dit_config=dit, bigvgan_config=bigvgan))
    torch.manual_seed(seed)
    model = Qwen2_5OmniForConditionalGeneration(config)
    model.thinker.generation_config.eos_token_id = REPLY_END
    generator = torch.Generator().manual_seed(seed)
    model.speaker_map = {"Tiny": {"bos_token": SPEAKER, "cond": torch.randn(1, 8, generator=generator),
                                  "ref_mel": torch.randn(1, 6, 8, generator=generator)}}
    return model


class OmniRows(torch.utils.data.Dataset):
    """`n` rows: a prompt (every `audio_every`-th row a 16-frame clip, every `image_every`-th a 4x4-patch image, and
    3 text tokens), a reply of 2-5 text tokens ending in the end-of-turn, and 2-6 speech codes ending in the codec
    end token (every `silent_every`-th row no speech: codes all -100)."""

    def __init__(self, n: int, seed: int = 0, audio_every: int = 2, image_every: int = 3, silent_every: int = 4):
        generator = torch.Generator().manual_seed(seed)
        draw = lambda lo, hi, k: torch.randint(lo, hi, (k,), generator=generator).tolist()  # noqa: E731
        self.rows = []
        for i in range(n):
            prompt, row = [], {}
            if audio_every and i % audio_every == 0:
                prompt += [AUDIO_START] + [AUDIO] * 4 + [AUDIO_END]  # 16 frames: 4 audio tokens
                row |= {"input_features": torch.randn(16, 16, generator=generator),
                        "feature_attention_mask": torch.ones(16, dtype=torch.long)}
            if image_every and i % image_every == 0:
                prompt += [VISION_START] + [IMAGE] * 4 + [VISION_END]  # 16 patches merged 2x2: 4 image tokens
                row |= {"pixel_values": torch.randn(16, 12, generator=generator),
                        "image_grid_thw": torch.tensor([1, 4, 4])}
            prompt += draw(6, 99, 3)
            reply = draw(6, 99, 1 + i % 4) + [REPLY_END]
            silent = silent_every and i % silent_every == silent_every - 1
            codes = [-100] * 6 if silent else draw(0, 124, 1 + i % 5) + [CODEC_END]
            row |= {"input_ids": torch.tensor(prompt + reply), "labels": torch.tensor([-100] * len(prompt) + reply),
                    "codec_ids": torch.tensor(codes), "speaker_token_ids": torch.tensor(SPEAKER)}
            self.rows.append(row)

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return self.rows[i]


def collate(rows: list[dict]) -> dict[str, torch.Tensor]:
    """Text padded on the left (pad 0, labels -100, mask 0), codes (or frames of codes) on the right (-100); images'
    patches concatenated with one grid row each (the grids also of rows whose pixels an offline cache serves);
    clips stacked with their frame masks. An offline encoder's batch (no text): its images only."""
    images = [r for r in rows if "pixel_values" in r]
    media = {}
    if images:
        media["pixel_values"] = torch.cat([r["pixel_values"] for r in images])
    if any("image_grid_thw" in r for r in rows):
        media["image_grid_thw"] = torch.stack([r["image_grid_thw"] for r in rows if "image_grid_thw" in r])
    if "input_ids" not in rows[0]:
        return media
    width = max(len(r["input_ids"]) for r in rows)
    codes = max(len(r["codec_ids"]) for r in rows)
    batch = {"input_ids": torch.zeros(len(rows), width, dtype=torch.long),
             "labels": torch.full((len(rows), width), -100, dtype=torch.long),
             "attention_mask": torch.zeros(len(rows), width, dtype=torch.long),
             "codec_ids": torch.full((len(rows), codes, *rows[0]["codec_ids"].shape[1:]), -100, dtype=torch.long),
             "speaker_token_ids": torch.stack([r["speaker_token_ids"] for r in rows])}
    for i, row in enumerate(rows):
        n = len(row["input_ids"])
        batch["input_ids"][i, width - n:] = row["input_ids"]
        batch["labels"][i, width - n:] = row["labels"]
        batch["attention_mask"][i, width - n:] = 1
        batch["codec_ids"][i, :len(row["codec_ids"])] = row["codec_ids"]
    batch |= media
    clips = [r for r in rows if "input_features" in r]
    if clips:
        batch["input_features"] = torch.stack([r["input_features"] for r in clips])
        batch["feature_attention_mask"] = torch.stack([r["feature_attention_mask"] for r in clips])
    return batch


JANUS_IMAGE, JANUS_BOI, JANUS_TOKENS = 99, 98, 16  # 16x16 images: 16 patches read, 16 VQ tokens drawn
JANUS = {"vision": "model.vision_model", "aligner": "model.aligner", "vq": "model.vqmodel",
         "generation": ["model.generation_embeddings", "model.generation_aligner", "model.generation_head"],
         "llm": ["model.language_model", "lm_head"]}


def janus(seed: int = 0):
    """Janus: a 2-layer SigLIP-style tower on 16x16 images, a VQ model (64 codes, 4x4 tokens), a 2-layer Llama
    with its `lm_head` tied to the embeddings; `generate(generation_mode="image")` configured."""
    from transformers import JanusConfig, JanusForConditionalGeneration

    vision = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, image_size=16, patch_size=4,
                  projection_dim=32, depth=2, num_image_tokens=JANUS_TOKENS, mlp_ratio=2.0)
    vq = dict(embed_dim=8, num_embeddings=64, latent_channels=32, base_channels=32, channel_multiplier=[1, 1, 1],
              num_res_blocks=1, num_patches=4, projection_dim=32, image_token_embed_dim=32, num_hidden_layers=1)
    text = dict(model_type="llama", vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128)
    config = JanusConfig(text_config=text, vision_config=vision, vq_config=vq, image_token_id=JANUS_IMAGE)
    torch.manual_seed(seed)
    model = JanusForConditionalGeneration(config)
    model.generation_config.pad_token_id = 0
    model.generation_config.generation_kwargs = {"boi_token_id": JANUS_BOI, "num_image_tokens": JANUS_TOKENS}
    return model


class JanusRows(torch.utils.data.Dataset):
    """`n` rows: every `draw_every`-th a generation row (a 3-5 token prompt ending in the begin-of-image token and
    a 16x16 image to draw), the others understanding rows (an image's 16 tokens, 2 prompt tokens, a 2-4 token
    caption as labels)."""

    def __init__(self, n: int, seed: int = 0, draw_every: int = 2):
        generator = torch.Generator().manual_seed(seed)
        draw = lambda k: torch.randint(3, 90, (k,), generator=generator).tolist()  # noqa: E731
        self.rows = []
        for i in range(n):
            image = torch.randn(3, 16, 16, generator=generator)
            if draw_every and i % draw_every == 0:
                self.rows.append({"generation_input_ids": torch.tensor(draw(2 + i % 3) + [JANUS_BOI]),
                                  "generation_pixel_values": image})
                continue
            prompt, caption = [JANUS_IMAGE] * JANUS_TOKENS + draw(2), draw(2 + i % 3)
            self.rows.append({"input_ids": torch.tensor(prompt + caption), "pixel_values": image,
                              "labels": torch.tensor([-100] * len(prompt) + caption)})

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return self.rows[i]


def janus_collate(rows: list[dict]) -> dict[str, torch.Tensor]:
    """Understanding rows and generation rows, each kind's text padded on the left."""
    batch = {}
    for prefix, key in (("", "input_ids"), ("generation_", "generation_input_ids")):
        kind = [r for r in rows if key in r]
        if not kind:
            continue
        width = max(len(r[key]) for r in kind)
        ids = torch.zeros(len(kind), width, dtype=torch.long)
        mask = torch.zeros(len(kind), width, dtype=torch.long)
        for i, row in enumerate(kind):
            ids[i, width - len(row[key]):] = row[key]
            mask[i, width - len(row[key]):] = 1
        batch |= {key: ids, f"{prefix}attention_mask": mask,
                  f"{prefix}pixel_values": torch.stack([r[f"{prefix}pixel_values"] for r in kind])}
        if prefix == "":
            labels = torch.full((len(kind), width), -100, dtype=torch.long)
            for i, row in enumerate(kind):
                labels[i, width - len(row["labels"]):] = row["labels"]
            batch["labels"] = labels
    return batch


Q3_IM_START, Q3_IM_END, Q3_USER, Q3_ASSISTANT, Q3_NEWLINE = 150, 151, 156, 157, 10
Q3_AUDIO, Q3_IMAGE, Q3_VISION_START, Q3_AUDIO_START, Q3_AUDIO_END, Q3_VISION_END = 140, 141, 143, 144, 145, 146
Q3_SPEAKER, Q3_CODEC_END, Q3_GROUPS = 1096, 1090, 3
QWEN3_OMNI = {"audio": "thinker.model.audio_tower", "vision": "thinker.model.visual",
              "llm": ["thinker.model.language_model", "thinker.lm_head"],
              "talker": ["talker.model", "talker.text_projection", "talker.hidden_projection", "talker.codec_head",
                         "talker.code_predictor.model", "talker.code_predictor.lm_head"],
              "code2wav": "code2wav"}


def qwen3_omni(seed: int = 0):
    """Qwen3-Omni-MoE: thinker (2-layer audio tower, 2-block vision tower with a deepstack layer, 2-layer MoE LLM
    with 4 experts), talker (2-layer MoE, 1100 first-codebook codes: `generate` suppresses the top 1024 but the end
    token), a 1-layer code predictor for 2 more codebooks, a small code2wav; one speaker. The fields the config
    classes do not declare but the models read (`spatial_merge_size`, `shared_expert_intermediate_size`, the
    talker's `audio_config`) are set."""
    from transformers import Qwen3OmniMoeConfig, Qwen3OmniMoeForConditionalGeneration

    rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_interleaved": True}
    audio = dict(num_mel_bins=16, encoder_layers=2, encoder_attention_heads=2, encoder_ffn_dim=32, d_model=16,
                 max_source_positions=64, n_window=50, output_dim=32, n_window_infer=100, conv_chunksize=8,
                 downsample_hidden_size=8)
    vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, in_channels=3, patch_size=2,
                  spatial_merge_size=2, temporal_patch_size=1, out_hidden_size=32, num_position_embeddings=16,
                  deepstack_visual_indexes=[0])
    moe = dict(moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2, shared_expert_intermediate_size=16)
    text = dict(vocab_size=160, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                num_key_value_heads=1, head_dim=16, max_position_embeddings=256,
                rope_parameters={**rope, "mrope_section": [4, 2, 2]}, **moe)
    tokens = dict(audio_token_id=Q3_AUDIO, image_token_id=Q3_IMAGE, video_token_id=142,
                  vision_start_token_id=Q3_VISION_START, audio_start_token_id=Q3_AUDIO_START)
    thinker = dict(audio_config=audio, vision_config=vision, text_config=text, user_token_id=Q3_USER, **tokens)
    talker_text = dict(vocab_size=1100, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                       num_attention_heads=2, num_key_value_heads=1, head_dim=8, max_position_embeddings=512,
                       rope_parameters={**rope, "mrope_section": [2, 1, 1]}, **moe)
    predictor = dict(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                     num_key_value_heads=1, head_dim=8, max_position_embeddings=64, num_code_groups=Q3_GROUPS)
    talker = dict(code_predictor_config=predictor, text_config=talker_text, num_code_groups=Q3_GROUPS,
                  thinker_hidden_size=32, codec_eos_token_id=Q3_CODEC_END, accept_hidden_layer=1,
                  codec_nothink_id=1091, codec_think_bos_id=1092, codec_think_eos_id=1093, codec_pad_id=1094,
                  codec_bos_id=1095, speaker_id={"tiny": Q3_SPEAKER}, spatial_merge_size=2, **tokens)
    code2wav = dict(codebook_size=128, hidden_size=16, max_position_embeddings=64, num_attention_heads=2,
                    num_key_value_heads=2, intermediate_size=32, num_hidden_layers=1, num_quantizers=Q3_GROUPS,
                    upsample_rates=[2, 2], upsampling_ratios=[2], decoder_dim=16, sliding_window=8)
    config = Qwen3OmniMoeConfig(thinker_config=thinker, talker_config=talker, code2wav_config=code2wav,
                                im_start_token_id=Q3_IM_START, im_end_token_id=Q3_IM_END, tts_pad_token_id=152,
                                tts_bos_token_id=153, tts_eos_token_id=154, system_token_id=155,
                                user_token_id=Q3_USER, assistant_token_id=Q3_ASSISTANT)
    config.talker_config.audio_config = config.thinker_config.audio_config  # its get_rope_index reads it (undeclared)
    torch.manual_seed(seed)
    model = Qwen3OmniMoeForConditionalGeneration(config)
    with torch.no_grad():  # a build from the config leaves the talker's experts as allocated (torch.empty): drawn here
        for name, p in model.talker.named_parameters():
            if ".experts." in name:
                p.normal_(0.0, config.talker_config.text_config.initializer_range)
    return model


class Qwen3OmniRows(torch.utils.data.Dataset):
    """`n` chat rows: a system turn, a user turn (every `audio_every`-th with a 16-frame clip, every `image_every`-th
    with a 4x4-patch image, and 2-3 text tokens), the assistant header, a reply of 2-5 tokens ending in
    `<|im_end|>`; 2-5 frames of 3 codebooks of speech codes (the last frame: the codec end token, its other
    codebooks absent), every `silent_every`-th row none."""

    def __init__(self, n: int, seed: int = 0, audio_every: int = 2, image_every: int = 3, silent_every: int = 4):
        generator = torch.Generator().manual_seed(seed)
        draw = lambda lo, hi, k: torch.randint(lo, hi, (k,), generator=generator).tolist()  # noqa: E731
        self.rows = []
        for i in range(n):
            user, row = [Q3_IM_START, Q3_USER, Q3_NEWLINE], {}
            if audio_every and i % audio_every == 0:
                user += [Q3_AUDIO_START] + [Q3_AUDIO] * 2 + [Q3_AUDIO_END]  # 16 frames: 2 audio tokens
                row |= {"input_features": torch.randn(16, 16, generator=generator),
                        "feature_attention_mask": torch.ones(16, dtype=torch.long)}
            if image_every and i % image_every == 0:
                user += [Q3_VISION_START] + [Q3_IMAGE] * 4 + [Q3_VISION_END]
                row |= {"pixel_values": torch.randn(16, 12, generator=generator),
                        "image_grid_thw": torch.tensor([1, 4, 4])}
            user += draw(20, 99, 2 + i % 2) + [Q3_IM_END, Q3_NEWLINE]
            prompt = [Q3_IM_START, 155, Q3_NEWLINE, 11, Q3_IM_END, Q3_NEWLINE] + user + [Q3_IM_START, Q3_ASSISTANT,
                                                                                          Q3_NEWLINE]
            reply = draw(20, 99, 1 + i % 4) + [Q3_IM_END]
            codes = torch.full((5, Q3_GROUPS), -100)
            if not (silent_every and i % silent_every == silent_every - 1):
                frames = 1 + i % 4
                codes[:frames, 0] = torch.randint(0, 76, (frames,), generator=generator)
                codes[:frames, 1:] = torch.randint(0, 64, (frames, Q3_GROUPS - 1), generator=generator)
                codes[frames, 0] = Q3_CODEC_END
            row |= {"input_ids": torch.tensor(prompt + reply), "labels": torch.tensor([-100] * len(prompt) + reply),
                    "codec_ids": codes, "speaker_token_ids": torch.tensor(Q3_SPEAKER)}
            self.rows.append(row)

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return self.rows[i]
