"""The kinds of modules users compose, as tiny configs: Llama and a MoE LLM (Mixtral: transformers 5 merges its
experts on load), Llama and Gemma with tied embeddings, ViT (with a pooler the forward never uses), a BatchNorm CNN
(ResNet), BERT, CLIP and SigLIP vision towers, a T5 encoder (its `shared` embeddings tied, `wo` kept in fp32 for fp16
loads), Whisper's encoder and Qwen2-VL's vision tower (classes transformers does not export at its top level).
`MultiEncoder` feeds every encoder's pooled features through one projector into the LLM."""

from __future__ import annotations

import torch
from transformers import (
    BertConfig, BertModel, CLIPVisionConfig, CLIPVisionModel, GemmaConfig, GemmaForCausalLM, LlamaConfig,
    LlamaForCausalLM, MixtralConfig, MixtralForCausalLM, ResNetConfig, ResNetModel, SiglipVisionConfig,
    SiglipVisionModel, T5Config, T5EncoderModel, ViTConfig, ViTModel, WhisperConfig,
)
from transformers.models.qwen2_vl.configuration_qwen2_vl import Qwen2VLVisionConfig
from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VisionTransformerPretrainedModel
from transformers.models.whisper.modeling_whisper import WhisperEncoder

from hf_omni import OmniModel, Projector, ProjectorConfig

H, VOCAB, IMAGE, PATCH = 16, 32, 16, 4
TOWER = dict(hidden_size=H, intermediate_size=H, num_hidden_layers=1, num_attention_heads=2, image_size=IMAGE,
             patch_size=8, num_channels=1)
LLM = dict(vocab_size=VOCAB, hidden_size=H, intermediate_size=H, num_hidden_layers=1, num_attention_heads=2,
           num_key_value_heads=1)
ENCODERS = {
    "vit": lambda: ViTModel(ViTConfig(**TOWER)),  # pooler built, never used by the forward below
    "resnet": lambda: ResNetModel(ResNetConfig(num_channels=1, embedding_size=8, hidden_sizes=[H], depths=[1],
                                               layer_type="basic")),
    "bert": lambda: BertModel(BertConfig(vocab_size=VOCAB, hidden_size=H, intermediate_size=H, num_hidden_layers=1,
                                         num_attention_heads=2)),
    "clip": lambda: CLIPVisionModel(CLIPVisionConfig(**TOWER)),
    "siglip": lambda: SiglipVisionModel(SiglipVisionConfig(**TOWER)),
    "t5": lambda: T5EncoderModel(T5Config(vocab_size=VOCAB, d_model=H, d_kv=8, d_ff=H, num_layers=1, num_heads=2)),
    "whisper": lambda: WhisperEncoder(WhisperConfig(num_mel_bins=IMAGE, d_model=H, encoder_layers=1, vocab_size=VOCAB,
                                                    encoder_attention_heads=2, encoder_ffn_dim=H,
                                                    max_source_positions=IMAGE // 2)),
    "qwen2vl": lambda: Qwen2VisionTransformerPretrainedModel(Qwen2VLVisionConfig(
        depth=1, embed_dim=H, hidden_size=H, num_heads=2, in_channels=1, patch_size=PATCH, spatial_merge_size=2,
        temporal_patch_size=1, mlp_ratio=1)),
}
LLMS = {
    "llama": lambda: LlamaForCausalLM(LlamaConfig(**LLM)),
    "mixtral": lambda: MixtralForCausalLM(MixtralConfig(**LLM, num_local_experts=2, num_experts_per_tok=1)),
    "llama_tied": lambda: LlamaForCausalLM(LlamaConfig(**LLM, tie_word_embeddings=True)),
    "gemma": lambda: GemmaForCausalLM(GemmaConfig(**LLM, head_dim=8, pad_token_id=0, bos_token_id=1, eos_token_id=2)),
}
# LoRA targets per module kind: attention projections, and (lora_emb) the token / position embeddings too
ATTENTION = {"vit": ["q_proj", "v_proj"], "bert": ["query", "value"], "clip": ["q_proj", "v_proj"],
             "siglip": ["q_proj", "v_proj"], "resnet": ["convolution"], "llm": ["q_proj", "v_proj"], "t5": ["q", "v"],
             "whisper": ["q_proj", "v_proj"], "qwen2vl": ["qkv"]}
EMBEDDINGS = {"bert": ["word_embeddings"], "clip": ["position_embedding"], "siglip": ["position_embedding"],
              "llm": ["embed_tokens"], "t5": ["embed_tokens"]}
NORMS = {"vit": "layernorm", "t5": "final_layer_norm", "whisper": "layer_norm", "qwen2vl": "ln_q"}  # modules_to_save


def patches(pixel_values):
    """Qwen2-VL's input: every image's PATCH x PATCH patches flattened in rows, and each image's (t, h, w) grid (the
    2 x 2 merge order its processor uses)."""
    n, c, size = pixel_values.shape[0], pixel_values.shape[1], IMAGE // PATCH
    x = pixel_values.reshape(n, c, size // 2, 2, PATCH, size // 2, 2, PATCH).permute(0, 2, 5, 3, 6, 1, 4, 7)
    grid = torch.tensor([[1, size, size]] * n)
    return x.reshape(n * size * size, c * PATCH * PATCH), grid


def encode(name: str, module, pixel_values, text_ids):
    """An encoder's output on the batch (its own input kind)."""
    if name in ("bert", "t5"):
        return module(input_ids=text_ids).last_hidden_state
    if name == "whisper":  # a 16 x 16 image read as 16 mel bins x 16 frames
        return module(input_features=pixel_values[:, 0].to(module.dtype)).last_hidden_state
    if name == "qwen2vl":  # merged tokens (4 per image)
        flat, grid = patches(pixel_values.to(module.dtype))
        return module(flat, grid_thw=grid).pooler_output.reshape(len(pixel_values), -1, H)
    return module(pixel_values=pixel_values.to(module.dtype))


def features(name: str, module, pixel_values, text_ids):
    """One pooled feature vector per sample from an encoder (ViT: the CLS token, so its pooler stays unused)."""
    if name in ("bert", "t5", "whisper"):
        return encode(name, module, pixel_values, text_ids)[:, 0]
    if name == "qwen2vl":
        return encode(name, module, pixel_values, text_ids).mean(1)
    out = module(pixel_values=pixel_values.to(module.dtype))
    if name == "vit":
        return out.last_hidden_state[:, 0]
    return out.pooler_output.flatten(1)


class MultiEncoder(OmniModel):
    """encoders -> projector -> one prefix token per encoder -> LLM (labels: -100 under the prefix)."""

    def forward(self, input_ids, pixel_values, text_ids, labels=None, **kw):
        names = [n for n in self.module_names if n not in ("projector", "llm")]
        feats = torch.stack([features(n, getattr(self, n), pixel_values, text_ids).to(self.projector.dtype)
                             for n in names], dim=1)
        prefix = self.projector(feats)
        embeds = self.llm.get_input_embeddings()(input_ids)
        embeds = torch.cat([prefix.to(embeds.dtype), embeds], dim=1)
        if labels is not None:
            labels = torch.cat([labels.new_full(prefix.shape[:2], -100), labels], dim=1)
        return self.llm(inputs_embeds=embeds, labels=labels, **kw)


def build(encoders: list[str], llm: str = "llama", seed: int = 0) -> MultiEncoder:
    torch.manual_seed(seed)
    modules = {name: ENCODERS[name]() for name in encoders}
    modules["projector"] = Projector(ProjectorConfig(in_features=H, out_features=H))
    modules["llm"] = LLMS[llm]()
    return MultiEncoder.from_modules(modules)


class Batches(torch.utils.data.Dataset):
    """Deterministic random samples: an image, a short text for BERT, a caption for the LLM."""

    def __init__(self, n: int = 32, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.pixels = torch.randn(n, 1, IMAGE, IMAGE, generator=g)
        self.text = torch.randint(1, VOCAB, (n, 5), generator=g)
        self.ids = torch.randint(1, VOCAB, (n, 6), generator=g)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"pixel_values": self.pixels[i], "text_ids": self.text[i], "input_ids": self.ids[i],
                "labels": self.ids[i]}


def mode_overlay(name: str, mode: str) -> dict:
    """A `modules.<name>` entry for a training mode: full | frozen | lora | dora | lora_emb | rslora | to_save."""
    kind = "llm" if name == "llm" else name
    if mode == "full":
        return {"learning_rate": 1e-2}
    if mode == "frozen":
        return {"trainable": False}
    lora = {"r": 2, "lora_alpha": 4, "target_modules": list(ATTENTION[kind]), "init_lora_weights": False}
    if mode == "dora":
        lora["use_dora"] = True
    elif mode == "lora_emb":
        lora["target_modules"] += EMBEDDINGS[kind]
    elif mode == "rslora":
        lora["use_rslora"] = True
    elif mode == "to_save":
        lora["modules_to_save"] = [NORMS.get(kind, "post_layernorm")]
    return {"learning_rate": 1e-2, "lora": lora}
