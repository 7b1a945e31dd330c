"""The text-to-image demo: a tiny pixel-space diffusion model (IFPipeline: frozen random T5 + UNet) learns to draw
scikit-learn's handwritten digits from prompts such as "a handwritten 7", trained per module by OmniTrainer.

    python examples/text_to_image.py examples/text_to_image.yaml [--seed 1 --output_dir runs/t2i-1 ...]

Trains on half the digits; a logistic regression fit on the other half reads 10 samples of each digit
(fixed seed, fixed steps) drawn through `model.to_pipeline()`. Prints the share read as the prompted digit and the
training time; writes the pipeline folder (IFPipeline.from_pretrained loads it) and samples.png (a row per digit).
"""

import os
import sys
import time
from dataclasses import dataclass, field

from transformers import HfArgumentParser, set_seed

from hf_omni import OmniTrainer, OmniTrainingArguments
from hf_omni.testing.digits_t2i import (
    DigitPrompts, DigitT2I, build_pipeline, fit_scorer, generate, grid, load_splits, score,
)


@dataclass
class DemoArguments:
    train_rows: int | None = field(default=None, metadata={"help": "Train on the first N training digits only."})
    sampling_steps: int = field(default=50, metadata={"help": "DDPM steps per sample."})
    guidance_scale: float = field(default=3.0, metadata={"help": "Classifier-free guidance against the empty prompt."})
    per_digit: int = field(default=10, metadata={"help": "Samples of each digit to score."})


def parse_args(argv: list[str]) -> tuple[OmniTrainingArguments, DemoArguments]:
    """`text_to_image.py config.yaml [--key value ...]`: the file's values, overridden by CLI flags after it."""
    parser = HfArgumentParser((OmniTrainingArguments, DemoArguments))
    if argv and argv[0].endswith((".yaml", ".yml", ".json")):
        import yaml

        with open(argv[0]) as f:
            parser.set_defaults(**yaml.safe_load(f))
        argv = argv[1:]
    return tuple(parser.parse_args_into_dataclasses(args=argv))


def main(argv: list[str]) -> dict:
    """Train, save, sample, score. Returns {"score", "train_seconds", "train_cpu_seconds", "output_dir"}."""
    args, demo = parse_args(argv)
    set_seed(args.seed)
    model = DigitT2I.from_pipeline(build_pipeline(seed=args.seed))
    (train_x, train_y), (held_x, held_y) = load_splits()
    rows = slice(None, demo.train_rows)
    train_set = DigitPrompts(train_x[rows], train_y[rows], model.processors["text_encoder"])
    trainer = OmniTrainer(model=model, args=args, train_dataset=train_set)
    start, cpu_start = time.perf_counter(), time.process_time()
    trainer.train()
    seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
    trainer.save_model()
    model.eval()
    images, digits = generate(model.to_pipeline(), demo.per_digit, demo.sampling_steps, demo.guidance_scale)
    result = {"score": score(fit_scorer(held_x, held_y), images, digits), "train_seconds": seconds,
              "train_cpu_seconds": cpu_seconds, "output_dir": args.output_dir}
    if trainer.is_world_process_zero():
        grid(images, demo.per_digit).save(os.path.join(args.output_dir, "samples.png"))
        print(f"score: {result['score']:.1%} of {len(images)} samples read as the prompted digit "
              f"({demo.sampling_steps} sampling steps, guidance {demo.guidance_scale}); "
              f"{trainer.state.global_step} steps, {seconds:.0f} s of training ({cpu_seconds:.0f} s of CPU time); "
              f"pipeline in {args.output_dir}")
    trainer.end()
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
