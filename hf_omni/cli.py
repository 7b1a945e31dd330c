"""`hf-omni export CHECKPOINT OUT`: a checkpoint as a plain per-module export, in one process (no training job,
no process group). Trainable modules come from the checkpoint, frozen ones from their recorded source; the
result is what `save_model()` writes, ready for `from_pretrained` or upload.

`hf-omni push CHECKPOINT_OR_EXPORT REPO_ID [--hub-layout single] [--private] [--revision BRANCH]`: module repos
plus the composition repo (see `hub.push`); the token comes from `HF_TOKEN` or `hf auth login`, never the
command line.

`hf-omni encode SCRIPT CONFIG [...]`: the training script's offline caches only (`offline_modules`); under
`accelerate launch -m hf_omni.cli encode ...` every rank encodes its rows."""

from __future__ import annotations

import argparse
import os
import shutil

from .checkpoint.contents import check_complete
from .checkpoint.marker import MARKER
from .checkpoint.module_state import STATE
from .core.config import OmniConfig
from .files.composition import composition_of
from .hub.ids import HUB_LAYOUTS
from .hub.push import push_saved
from .offline.serve import ENCODE_ONLY


def export(checkpoint: str, out: str) -> None:
    check_complete(checkpoint, verify=None)  # every file (headers, JSON; sha256 when recorded) before any write
    config = OmniConfig.from_pretrained(checkpoint)
    if os.path.exists(out) and os.listdir(out):
        raise FileExistsError(f"{out} exists and is not empty: nothing was written")
    partial = os.path.join(os.path.dirname(os.path.abspath(out)), f".{os.path.basename(out)}.partial")
    shutil.rmtree(partial, ignore_errors=True)  # left by an export that was killed
    composition_of(config).export_checkpoint(checkpoint, config, partial)
    if os.path.isdir(out):
        os.rmdir(out)  # empty (checked above)
    os.replace(partial, out)  # an interrupted export never leaves a folder that looks complete


def push(folder: str, repo_id: str, hub_layout: str | None, private: bool, revision: str | None) -> dict[str, str]:
    """Push an export, or a complete checkpoint (its sha256s checked when it recorded them)."""

    if os.path.exists(os.path.join(folder, MARKER)):
        check_complete(folder, verify=None)
    elif any(os.path.isdir(os.path.join(folder, n, STATE)) for n in os.listdir(folder)):
        raise ValueError(f"{folder} is a checkpoint without its completion marker (a save cut short): not pushed")
    return push_saved(folder, repo_id, layout=hub_layout, private=private or None, revision=revision)


def encode(script: str, script_args: list[str]) -> None:
    """Run a training script (`python SCRIPT ARGS...`, e.g. `examples/train.py config.yaml`) up to its
    `OmniTrainer.train()`, which only builds the offline caches its config asks for and ends the run."""
    import runpy
    import sys

    os.environ[ENCODE_ONLY] = "1"
    sys.argv = [script, *script_args]
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as done:
        if done.code not in (None, 0):
            raise
        return
    raise RuntimeError(f"{script} ended without calling OmniTrainer.train(): nothing was encoded")


def build_parser() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    """The `hf-omni` parser and its commands' parsers (docs/cli.md is generated from their help)."""
    parser = argparse.ArgumentParser(prog="hf-omni", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    export_parser = commands.add_parser("export", help="a checkpoint as config.json + one HF folder per module")
    export_parser.add_argument("checkpoint")
    export_parser.add_argument("out")
    push_parser = commands.add_parser("push", help="push an export or checkpoint: module repos + composition repo")
    push_parser.add_argument("folder")
    push_parser.add_argument("repo_id")
    push_parser.add_argument("--hub-layout", default=None, choices=HUB_LAYOUTS, help="a composed model's layout "
                             "(default per_module); unset for an adopted model (one repo, its released format)")
    push_parser.add_argument("--private", action="store_true", help="create missing repos private")
    push_parser.add_argument("--revision", default=None, help="the branch to push to (created from main)")
    encode_parser = commands.add_parser("encode", help="only build the offline caches of a training run: "
                                        "hf-omni encode train.py config.yaml [--key value ...]")
    encode_parser.add_argument("script")
    encode_parser.add_argument("script_args", nargs=argparse.REMAINDER)
    return parser, {"export": export_parser, "push": push_parser, "encode": encode_parser}


def main(argv: list[str] | None = None) -> None:
    args = build_parser()[0].parse_args(argv)
    if args.command == "export":
        export(args.checkpoint, args.out)
        print(f"exported {args.checkpoint} to {args.out}")
    elif args.command == "push":
        for repo, oid in push(args.folder, args.repo_id, args.hub_layout, args.private, args.revision).items():
            print(f"pushed {repo} @ {oid}")
    elif args.command == "encode":
        encode(args.script, args.script_args)


if __name__ == "__main__":
    main()
