"""`hf-omni export CHECKPOINT OUT`: a checkpoint as a plain per-module export, in one process (no training job,
no process group). Trainable modules come from the checkpoint, frozen ones from their recorded source; the
result is what `save_model()` writes, ready for `from_pretrained` or upload."""

from __future__ import annotations

import argparse
import os
import shutil

from .checkpoint_files import check_complete
from .config import OmniConfig, module_folder
from .module_io import copy_module_folder


def export(checkpoint: str, out: str) -> None:
    check_complete(checkpoint, verify=None)  # sha256 of every file, when the checkpoint recorded them
    config = OmniConfig.from_pretrained(checkpoint)
    if os.path.exists(out) and os.listdir(out):
        raise FileExistsError(f"{out} exists and is not empty: nothing was written")
    folders = {name: module_folder(checkpoint, config, name) for name in config.module_names}  # all, before writing
    partial = os.path.join(os.path.dirname(os.path.abspath(out)), f".{os.path.basename(out)}.partial")
    shutil.rmtree(partial, ignore_errors=True)  # left by an export that was killed
    for name, folder in folders.items():
        copy_module_folder(folder, os.path.join(partial, config.module_entry(name)["subfolder"]))
    config.save_pretrained(partial)
    if os.path.isdir(out):
        os.rmdir(out)  # empty (checked above)
    os.replace(partial, out)  # an interrupted export never leaves a folder that looks complete


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
