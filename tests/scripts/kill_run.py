"""A training run that kills itself with SIGKILL: `mid_step` at step 7 (checkpoint-5 complete), `mid_save` at the
step-10 save after every shard is written and before the completion marker.

Usage: kill_run.py MODE OUT_DIR (single process)."""

import os
import signal
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from checkpoint_scenario import make_trainer  # noqa: E402
from transformers import TrainerCallback  # noqa: E402

import hf_omni.checkpoint_files  # noqa: E402


def kill():
    os.kill(os.getpid(), signal.SIGKILL)


class KillMidStep(TrainerCallback):
    def on_substep_end(self, args, state, control, **kwargs):
        if state.global_step == 6:  # inside step 7: after the first micro-step's backward
            kill()


def main(mode: str, out_dir: str):
    callbacks = []
    if mode == "mid_step":
        callbacks.append(KillMidStep())
    elif mode == "mid_save":
        original = hf_omni.checkpoint_files.write_marker

        def write_marker(directory, info):
            if info["step"] == 10:
                kill()
            original(directory, info)

        hf_omni.checkpoint_files.write_marker = write_marker
    make_trainer(out_dir, callbacks=callbacks).train()
    raise SystemExit("the run was meant to be killed")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
