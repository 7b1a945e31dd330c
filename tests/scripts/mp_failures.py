"""A rank that fails alone, at 2 ranks: `write` — rank 0 cannot write the step-4 checkpoint's module files (a full
disk, injected); `read` — rank 1 cannot read the checkpoint it resumes from. Each rank writes the error it raised
to OUT_DIR/rank<r>.txt and exits 1. Runs under `accelerate launch` or as plain processes (RANK, WORLD_SIZE, ...).

Usage: mp_failures.py MODE OUT_DIR"""

import errno
import os
import sys
import traceback

from checkpoint_scenario import make_trainer

import hf_omni.checkpoint.resume
import hf_omni.files.folder_write
from launching import end_distributed


def fail_writing_on_rank0_at_step4():
    """Rank 0's writes of its rows of the step-4 checkpoint's weights files fail (pwrite: ENOSPC)."""
    original = hf_omni.files.folder_write.Files.write

    def write(self, name, offset, data):
        if "checkpoint-4" in self.folder and os.environ.get("RANK", "0") == "0" and name.endswith(".safetensors"):
            raise OSError(errno.ENOSPC, "No space left on device", os.path.join(self.folder, name))
        return original(self, name, offset, data)

    hf_omni.files.folder_write.Files.write = write


def fail_reading_on_rank1():
    original = hf_omni.checkpoint.resume.read_into

    def read_into(module, folder, *args, **kwargs):
        if os.environ.get("RANK") == "1":
            raise ValueError(f"{folder}/model.safetensors: truncated (injected on rank 1)")
        return original(module, folder, *args, **kwargs)

    hf_omni.checkpoint.resume.read_into = read_into


def main(mode: str, out_dir: str):
    rank = os.environ.get("RANK", "0")
    try:
        if mode in ("write", "write_async"):  # async: the write fails in rank 0's background thread
            fail_writing_on_rank0_at_step4()
            make_trainer(os.path.join(out_dir, "run"), max_steps=6, save_steps=2, save_total_limit=None,
                         save_async=mode == "write_async").train()
        else:
            fail_reading_on_rank1()
            make_trainer(os.path.join(out_dir, "run"), max_steps=6, save_steps=2).train(
                resume_from_checkpoint=os.path.join(out_dir, "run", "checkpoint-2"))
    except Exception as err:  # noqa: BLE001 - the test reads what each rank raised
        with open(os.path.join(out_dir, f"rank{rank}.txt"), "w") as f:
            f.write(f"{type(err).__name__}: {err}")
        traceback.print_exc()
        end_distributed(1)
    end_distributed(0)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
