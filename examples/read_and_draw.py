"""One model that reads and draws: a ViT + Llama captioner whose LLM also conditions a pixel-space diffusion
decoder (through a small connector) that draws digits from prompts, trained jointly by OmniTrainer from batches
mixing both tasks, with per-module settings (hf_omni/testing/digits_omni.py).

    python examples/read_and_draw.py examples/configs/read_and_draw.yaml [--seed 1 --output_dir runs/rd-1 ...]
    accelerate launch --multi_gpu --num_processes 2 examples/read_and_draw.py examples/configs/read_and_draw.yaml

Trains on half of scikit-learn's digits; prints the held-out caption accuracy and the share of drawn digits (10 of
each, fixed seed) a logistic regression fit on the held-out half reads as the prompted digit; writes the
per-module export (the LLM a transformers folder, the decoder a diffusers one: its moving average) and samples.png.
"""

import os
import sys
import time
from dataclasses import dataclass, field

from transformers import HfArgumentParser, set_seed

from hf_omni import OmniTrainer, OmniTrainingArguments
from hf_omni.testing.digits_omni import DigitsReadDraw, ReadAndDraw, build_model, caption_accuracy, draw
from hf_omni.testing.digits_t2i import fit_scorer, grid, load_splits, score


@dataclass
class DemoArguments:
    train_rows: int | None = field(default=None, metadata={"help": "Train on the first N training digits only."})
    sampling_steps: int = field(default=50, metadata={"help": "DDPM steps per drawing."})
    guidance_scale: float = field(default=3.0, metadata={"help": "Classifier-free guidance against the empty prompt."})
    per_digit: int = field(default=10, metadata={"help": "Drawings of each digit to score."})


def parse_args(argv: list[str]) -> tuple[OmniTrainingArguments, DemoArguments]:
    """`read_and_draw.py config.yaml [--key value ...]`: the file's values, overridden by CLI flags after it."""
    parser = HfArgumentParser((OmniTrainingArguments, DemoArguments))
    if argv and argv[0].endswith((".yaml", ".yml", ".json")):
        import yaml

        with open(argv[0]) as f:
            parser.set_defaults(**yaml.safe_load(f))
        argv = argv[1:]
    return tuple(parser.parse_args_into_dataclasses(args=argv))


def main(argv: list[str]) -> dict:
    """Train, export, read, draw, score. Returns {"caption_accuracy", "drawing_score", "train_seconds", ...}."""
    import numpy as np

    args, demo = parse_args(argv)
    set_seed(args.seed)
    model = build_model(seed=args.seed)
    tokenizer = model.processors["llm"]
    (train_x, train_y), (held_x, held_y) = load_splits()
    rows = slice(None, demo.train_rows)
    trainer = OmniTrainer(model=model, args=args, train_dataset=DigitsReadDraw(train_x[rows], train_y[rows],
                                                                               tokenizer))
    start, cpu_start = time.perf_counter(), time.process_time()
    trainer.train()
    seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
    trainer.save_model()
    trainer.accelerator.wait_for_everyone()  # every rank reads the export the main process finished
    exported = ReadAndDraw.from_pretrained(args.output_dir).to(args.device)  # the decoder's moving average
    accuracy = caption_accuracy(exported, DigitsReadDraw(held_x, held_y, tokenizer))
    digits = np.repeat(np.arange(10), demo.per_digit)
    images = draw(exported, digits, tokenizer, demo.sampling_steps, demo.guidance_scale, seed=args.seed)
    result = {"caption_accuracy": accuracy, "drawing_score": score(fit_scorer(held_x, held_y), images, digits),
              "train_seconds": seconds, "train_cpu_seconds": cpu_seconds, "output_dir": args.output_dir}
    if trainer.is_world_process_zero():
        grid(images, demo.per_digit).save(os.path.join(args.output_dir, "samples.png"))
        print(f"held-out caption accuracy: {accuracy:.1%} ({len(held_y)} images); drawn digits read as prompted: "
              f"{result['drawing_score']:.1%} ({len(digits)} drawings); {seconds:.0f} s of training; export in "
              f"{args.output_dir}")
    trainer.end()
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
