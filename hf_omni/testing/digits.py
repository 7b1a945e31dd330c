"""A tiny VLM that names handwritten digits: ViT encoder + Projector + Llama-style LM (the demo's pieces).

Data: `sklearn.datasets.load_digits` (1,797 real 8x8 scans shipped with scikit-learn). Each image gets the
caption "this is a handwritten digit <name>"; the LM reads the projected image patches as a prefix.
Built from configs only (no download); the word-level tokenizer is built in-process and saved with the LM.
"""

from __future__ import annotations

import numpy as np
import torch
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast, ViTConfig, ViTModel

from ..modeling import OmniModel
from ..offline.encoder import offline_encoder
from ..projector import Projector, ProjectorConfig

DIGITS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]
SPECIAL = ["[PAD]", "[UNK]", "[BOS]", "[EOS]"]
PROMPT = ["this", "is", "a", "handwritten", "digit"]
VOCAB = SPECIAL + PROMPT + DIGITS  # 19 words


class Captioner(OmniModel):
    """Image patches -> projector -> LM prefix; the caption tokens follow. The vision encoder's patches can come
    from an offline cache (`offline_modules: [vision]`): `forward` then gets `image_features` instead of pixels."""

    @offline_encoder(module="vision", inputs=["pixel_values"], output="image_features")
    def encode_image(self, pixel_values):
        return self.vision(pixel_values=pixel_values).last_hidden_state

    def forward(self, input_ids, pixel_values=None, image_features=None, labels=None, **kw):
        feats = image_features if image_features is not None else self.encode_image(pixel_values)
        prefix = self.projector(feats)
        embeds = torch.cat([prefix, self.llm.get_input_embeddings()(input_ids)], dim=1)
        if labels is not None:  # no loss on the image prefix; the LM shifts the rest itself
            labels = torch.cat([labels.new_full(prefix.shape[:2], -100), labels], dim=1)
        return self.llm(inputs_embeds=embeds, labels=labels, **kw)


def build_tokenizer() -> PreTrainedTokenizerFast:
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(VOCAB)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="[PAD]", unk_token="[UNK]", bos_token="[BOS]",
                                   eos_token="[EOS]")


def build_model(hidden: int = 64, layers: int = 2, llm_hidden: int = 64, llm_layers: int = 2, seed: int = 0,
                vision_dropout: float = 0.0) -> Captioner:
    torch.manual_seed(seed)
    tokenizer = build_tokenizer()
    vit = ViTModel(ViTConfig(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=4,
                             intermediate_size=4 * hidden, image_size=8, patch_size=2, num_channels=1,
                             hidden_dropout_prob=vision_dropout, attention_probs_dropout_prob=vision_dropout),
                   add_pooling_layer=False)
    projector = Projector(ProjectorConfig(in_features=hidden, out_features=llm_hidden, hidden_size=llm_hidden))
    llm = LlamaForCausalLM(LlamaConfig(
        hidden_size=llm_hidden, intermediate_size=4 * llm_hidden, num_hidden_layers=llm_layers,
        num_attention_heads=4, num_key_value_heads=4, vocab_size=len(VOCAB), max_position_embeddings=64,
        pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, tie_word_embeddings=False))
    return Captioner.from_modules({"vision": vit, "projector": projector, "llm": llm},
                                  processors={"llm": tokenizer})


class DigitCaptions(torch.utils.data.Dataset):
    """(pixel_values [1, 8, 8] in [0, 1], input_ids = labels = [BOS] caption [EOS])."""

    def __init__(self, images: np.ndarray, targets: np.ndarray, tokenizer: PreTrainedTokenizerFast):
        self.pixels = torch.tensor(images, dtype=torch.float32).view(-1, 1, 8, 8) / 16.0
        ids = [tokenizer.convert_tokens_to_ids(["[BOS]"] + PROMPT + [DIGITS[t], "[EOS]"]) for t in targets]
        self.input_ids = torch.tensor(ids, dtype=torch.long)
        self.targets = torch.tensor(targets, dtype=torch.long)

    def __len__(self):
        return len(self.targets)

    def __getitem__(self, i):
        return {"pixel_values": self.pixels[i], "input_ids": self.input_ids[i], "labels": self.input_ids[i]}


def load_splits(tokenizer, held_out: float = 0.2, seed: int = 0):
    """Train / held-out split of scikit-learn's digits (stratified, fixed seed)."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    x_train, x_test, y_train, y_test = train_test_split(digits.data, digits.target, test_size=held_out,
                                                        random_state=seed, stratify=digits.target)
    return DigitCaptions(x_train, y_train, tokenizer), DigitCaptions(x_test, y_test, tokenizer)


@torch.no_grad()
def greedy_captions(model: Captioner, pixel_values: torch.Tensor, length: int) -> torch.Tensor:
    """[BOS] then `length - 1` greedy tokens, the whole model run again for each (no cache)."""
    device = next(model.parameters()).device
    pixels = pixel_values.to(device)
    ids = torch.full((len(pixels), 1), model.processors["llm"].bos_token_id, device=device)
    for _ in range(length - 1):
        logits = model(pixel_values=pixels, input_ids=ids).logits
        ids = torch.cat([ids, logits[:, -1:].argmax(-1)], dim=1)
    return ids


@torch.no_grad()
def caption_accuracy(model: Captioner, dataset: DigitCaptions, batch_size: int = 512) -> float:
    """Greedy-decode a caption for every image from [BOS]; the fraction equal to the reference caption."""
    was_training = model.training
    model.eval()
    correct = 0
    for start in range(0, len(dataset), batch_size):
        reference = dataset.input_ids[start:start + batch_size]
        ids = greedy_captions(model, dataset.pixels[start:start + batch_size], reference.shape[1])
        correct += (ids.cpu() == reference).all(dim=1).sum().item()
    model.train(was_training)
    return correct / len(dataset)
