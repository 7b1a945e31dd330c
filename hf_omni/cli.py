"""`hf-omni export CHECKPOINT OUT`: a checkpoint as a plain per-module export, in one process (no training job,
no process group). Trainable modules come from the checkpoint, frozen ones from their recorded source; the
result is what `save_model()` writes, ready for `from_pretrained` or upload."""

from __future__ import annotations

import argparse
import os

from .checkpoint_files import check_complete
from .config import OmniConfig, module_folder
from .module_io import copy_module_folder


def export(checkpoint: str, out: str) -> None:
    check_complete(checkpoint)
    config = OmniConfig.from_pretrained(checkpoint)
    if os.path.exists(out) and os.listdir(out):
        raise FileExistsError(f"{out} exists and is not empty: nothing was written")
    folders = {name: module_folder(checkpoint, config, name) for name in config.module_names}  # all, before writing
    os.makedirs(out, exist_ok=True)
    for name, folder in folders.items():
        copy_module_folder(folder, os.path.join(out, config.module_entry(name)["subfolder"]))
    config.save_pretrained(out)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="hf-omni", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    export_parser = commands.add_parser("export", help="a checkpoint as config.json + one HF folder per module")
    export_parser.add_argument("checkpoint")
    export_parser.add_argument("out")
    args = parser.parse_args(argv)
    if args.command == "export":
        export(args.checkpoint, args.out)
        print(f"exported {args.checkpoint} to {args.out}")


if __name__ == "__main__":
    main()
