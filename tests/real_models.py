"""The kinds of modules users compose, as tiny configs: Llama and a MoE LLM (Mixtral: transformers 5 merges its
experts on load), ViT (with a pooler the forward never uses), a BatchNorm CNN (ResNet), BERT, CLIP and SigLIP
vision towers. `MultiEncoder` feeds every encoder's pooled features through one projector into the LLM."""

from __future__ import annotations

import torch
from transformers import (
    BertConfig, BertModel, CLIPVisionConfig, CLIPVisionModel, LlamaConfig, LlamaForCausalLM, MixtralConfig,
    MixtralForCausalLM, ResNetConfig, ResNetModel, SiglipVisionConfig, SiglipVisionModel, ViTConfig, ViTModel,
)

from hf_omni import OmniModel, Projector, ProjectorConfig

H, VOCAB, IMAGE = 16, 32, 16
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
}
LLMS = {
    "llama": lambda: LlamaForCausalLM(LlamaConfig(**LLM)),
    "mixtral": lambda: MixtralForCausalLM(MixtralConfig(**LLM, num_local_experts=2, num_experts_per_tok=1)),
}
# LoRA targets per module kind: attention projections, and (lora_emb) the token / position embeddings too
ATTENTION = {"vit": ["q_proj", "v_proj"], "bert": ["query", "value"], "clip": ["q_proj", "v_proj"],
             "siglip": ["q_proj", "v_proj"], "resnet": ["convolution"], "llm": ["q_proj", "v_proj"]}
EMBEDDINGS = {"bert": ["word_embeddings"], "clip": ["position_embedding"], "siglip": ["position_embedding"],
              "llm": ["embed_tokens"]}


def features(name: str, module, pixel_values, text_ids):
    """One pooled feature vector per sample from an encoder (ViT: the CLS token, so its pooler stays unused)."""
    if name == "bert":
        return module(input_ids=text_ids).last_hidden_state[:, 0]
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
        lora["modules_to_save"] = ["layernorm" if kind == "vit" else "post_layernorm"]
    return {"learning_rate": 1e-2, "lora": lora}
