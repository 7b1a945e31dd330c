"""The demo: train the digits captioner (ViT + Projector + Llama-style LM) with per-module settings.

    python examples/train.py examples/configs/digits.yaml             # stage 1: every module from scratch
    python examples/train.py examples/configs/digits_stage2.yaml      # stage 2: from stage 1's export, frozen
                                                                      # vision served from its offline cache
    accelerate launch --multi_gpu --num_processes 2 examples/train.py examples/configs/digits.yaml

Prints held-out caption accuracy and writes the per-module export (<output_dir>/config.json +
<output_dir>/{vision,projector,llm}/, each loadable alone with its Auto class).
"""

import sys
import time
from dataclasses import dataclass, field

from transformers import HfArgumentParser, set_seed

from hf_omni import OmniTrainer, OmniTrainingArguments
from hf_omni.testing.digits import Captioner, build_model, caption_accuracy, load_splits


@dataclass
class DemoArguments:
    init_from: str | None = field(default=None, metadata={"help": "Start from this export (stage 2)."})


def parse_args(argv: list[str]) -> tuple[OmniTrainingArguments, DemoArguments]:
    """`train.py config.yaml [--key value ...]`: the file's values, overridden by any CLI flags after it."""
    parser = HfArgumentParser((OmniTrainingArguments, DemoArguments))
    if argv and argv[0].endswith((".yaml", ".yml", ".json")):
        import yaml

        with open(argv[0]) as f:
            parser.set_defaults(**yaml.safe_load(f))  # JSON is YAML too
        argv = argv[1:]
    return tuple(parser.parse_args_into_dataclasses(args=argv))


def main():
    args, demo = parse_args(sys.argv[1:])
    set_seed(args.seed)  # weights a load initialises (a ViT's unused pooler) are the same every run
    model = Captioner.from_pretrained(demo.init_from) if demo.init_from else build_model(seed=args.seed)
    train_set, held_out = load_splits(model.processors["llm"])
    trainer = OmniTrainer(model=model, args=args, train_dataset=train_set)
    start = time.perf_counter()
    trainer.train()
    seconds = time.perf_counter() - start
    trainer.save_model()
    if args.offline_modules:  # trained from the cache: the frozen encoder was never loaded; the export has it
        model = Captioner.from_pretrained(args.output_dir).to(args.device)
    accuracy = caption_accuracy(model, held_out)  # every rank: sharded modules run collectives
    if trainer.is_world_process_zero():
        print(f"held-out caption accuracy: {accuracy:.1%} ({len(held_out)} images) after {args.max_steps} steps, "
              f"{seconds:.0f} s of training; export in {args.output_dir}")
    trainer.end()  # destroys the process group (Trainer's own teardown; gloo aborts at exit without it)


if __name__ == "__main__":
    main()
