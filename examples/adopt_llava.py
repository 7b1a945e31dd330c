"""Fine-tune a released LLaVA checkpoint as it is, per module, and give it back in LLaVA's own format.

    python examples/adopt_llava.py examples/configs/adopt_llava.yaml [--key value ...]

(`--save_strategy steps --save_steps 200` writes checkpoints; `--resume_from_checkpoint runs/adopt_llava/checkpoint-400`
continues from one.)

The "release" is a tiny `LlavaForConditionalGeneration` written once to `runs/tiny-llava-release/` (nothing is
downloaded: a stand-in for `llava-hf/llava-1.5-7b-hf`, with its tokenizer). `OmniModel.from_model` adopts it with
its own `forward` and `generate`; the YAML freezes the vision tower, trains the projector and puts LoRA on the
language model; the export (`output_dir`) is a LLaVA folder that `LlavaForConditionalGeneration.from_pretrained`
loads alone. It learns to caption scikit-learn's handwritten digits and prints the held-out accuracy of the
exported model's `generate`. docs/fine_tune_released.md walks through it.
"""

import os
import sys
import time

import torch
from transformers import (
    CLIPVisionConfig, HfArgumentParser, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration,
    PreTrainedTokenizerFast, set_seed,
)

from hf_omni import OmniModel, OmniTrainer, OmniTrainingArguments
from hf_omni.testing.digits import DIGITS, PROMPT, VOCAB

RELEASE = "runs/tiny-llava-release"
MODULES = {"vision": "model.vision_tower", "projector": "model.multi_modal_projector",
           "llm": ["model.language_model", "lm_head"]}
IMAGE, PATCHES = "<image>", 16  # 8x8 digits in 2x2 patches: 16 image tokens


def tokenizer() -> PreTrainedTokenizerFast:
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = VOCAB + [IMAGE]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="[PAD]", unk_token="[UNK]", bos_token="[BOS]",
                                   eos_token="[EOS]")


def write_release(folder: str) -> None:
    """A randomly initialised tiny LLaVA and its tokenizer, saved as a released checkpoint is."""
    tok = tokenizer()
    torch.manual_seed(0)
    vision = CLIPVisionConfig(hidden_size=64, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                              image_size=8, patch_size=2, num_channels=3, projection_dim=64)
    text = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=256, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64,
                       pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    config = LlavaConfig(vision_config=vision, text_config=text, image_token_index=tok.convert_tokens_to_ids(IMAGE),
                         vision_feature_layer=-1, vision_feature_select_strategy="default", image_seq_length=PATCHES)
    LlavaForConditionalGeneration(config).save_pretrained(folder)
    tok.save_pretrained(folder)


class DigitRows(torch.utils.data.Dataset):
    """LLaVA rows: <image> x 16, [BOS] this is a handwritten digit <digit> [EOS]; labels only on the caption."""

    def __init__(self, images, targets, tok):
        self.pixels = (torch.tensor(images, dtype=torch.float32).view(-1, 1, 8, 8) / 16.0).expand(-1, 3, -1, -1)
        prefix = [tok.convert_tokens_to_ids(IMAGE)] * PATCHES
        self.rows = [prefix + tok.convert_tokens_to_ids(["[BOS]"] + PROMPT + [DIGITS[t], "[EOS]"]) for t in targets]
        self.prompt = len(prefix) + 1 + len(PROMPT)  # what generate starts from
        self.targets = list(targets)

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        ids = torch.tensor(self.rows[i])
        labels = ids.clone()
        labels[:PATCHES] = -100
        return {"input_ids": ids, "labels": labels, "pixel_values": self.pixels[i].contiguous()}


def splits(tok):
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    x_train, x_test, y_train, y_test = train_test_split(digits.data, digits.target, test_size=0.2, random_state=0,
                                                        stratify=digits.target)
    return DigitRows(x_train, y_train, tok), DigitRows(x_test, y_test, tok)


@torch.no_grad()
def generated_accuracy(model, rows: DigitRows, tok) -> float:
    """The exported model's own `generate`: the digit word it writes after the prompt."""
    model.eval()
    ids = torch.tensor([r[:rows.prompt] for r in rows.rows])
    out = model.generate(input_ids=ids, pixel_values=rows.pixels.contiguous(), max_new_tokens=1, do_sample=False,
                         pad_token_id=tok.pad_token_id)
    wanted = torch.tensor(tok.convert_tokens_to_ids([DIGITS[t] for t in rows.targets]))
    return (out[:, -1] == wanted).float().mean().item()


def parse_args(argv: list[str]) -> OmniTrainingArguments:
    """`adopt_llava.py config.yaml [--key value ...]`: the file's values, overridden by any CLI flags after it."""
    parser = HfArgumentParser(OmniTrainingArguments)
    if argv and argv[0].endswith((".yaml", ".yml", ".json")):
        import yaml

        with open(argv[0]) as f:
            parser.set_defaults(**yaml.safe_load(f))
        argv = argv[1:]
    return parser.parse_args_into_dataclasses(args=argv)[0]


def main(argv: list[str], release: str = RELEASE) -> float:
    """Train, export, reload the export with LLaVA's own class; returns the held-out accuracy (on rank 0)."""
    args = parse_args(argv)
    if not os.path.isfile(os.path.join(release, "config.json")):
        write_release(release)
    set_seed(args.seed)
    tok = PreTrainedTokenizerFast.from_pretrained(release)
    model = OmniModel.from_model(LlavaForConditionalGeneration, release, modules=MODULES, processor=tok)
    train_set, held_out = splits(tok)
    trainer = OmniTrainer(model=model, args=args, train_dataset=train_set)
    start = time.perf_counter()
    trainer.train(resume_from_checkpoint=args.resume_from_checkpoint)  # --resume_from_checkpoint runs/x/checkpoint-N
    seconds = time.perf_counter() - start
    trainer.save_model()  # output_dir: a LLaVA folder (config.json, model.safetensors, tokenizer) + hf_omni.json
    accuracy = float("nan")
    if trainer.is_world_process_zero():
        exported = LlavaForConditionalGeneration.from_pretrained(args.output_dir)
        accuracy = generated_accuracy(exported, held_out, tok)
        print(f"held-out caption accuracy of the exported LLaVA's generate: {accuracy:.1%} ({len(held_out)} "
              f"images) after {args.max_steps} steps, {seconds:.0f} s of training; export in {args.output_dir}")
    trainer.end()
    return accuracy


if __name__ == "__main__":
    main(sys.argv[1:])
