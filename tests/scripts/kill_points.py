"""SIGKILL at many points of training, saving, rotation and export, each followed by a resume.

One process imports everything once (single-threaded, so forking is safe), then for every kill point forks a
child that arms the point (by wrapping a named function or hooking the model) and trains until it kills itself;
another forked child resumes with `resume_from_checkpoint=True` and writes what it ended with. Rank 0 of one
process, the shared 15-step run of tests/checkpoint_scenario.py (checkpoints at 5, 10, 15; keep 1).

Usage: kill_points.py OUT_DIR  ->  OUT_DIR/results.pt {point: facts}"""

import os
import signal
import sys

os.environ["OMP_NUM_THREADS"] = "1"  # no OpenMP pool in the parent: forked children stay safe

import torch
from checkpoint_scenario import make_trainer
from transformers import TrainerState

import hf_omni.checkpoint.bases as bases
import hf_omni.checkpoint.contents as contents
import hf_omni.checkpoint.marker as marker
import hf_omni.checkpoint.module_state as module_state
import hf_omni.checkpoint.async_save as async_save_module
import hf_omni.checkpoint.writer_process as writer_process
import hf_omni.cli
import hf_omni.compositions.plain as plain
import hf_omni.files.folder_write as module_io
from hf_omni.checkpoint.checkpointer import ModuleCheckpointer
from hf_omni.modeling import OmniModel
from hf_omni.trainer.trainer import OmniTrainer

torch.set_num_threads(1)


def die():
    """SIGKILL the run: in the writer process of an async save, its parent (the training process) first."""
    if writer_process.IN_WRITER:
        os.kill(os.getppid(), signal.SIGKILL)
    os.kill(os.getpid(), signal.SIGKILL)


def kill_on_call(owner, name: str, when, before: bool = True):
    """Wrap owner.name: SIGKILL before (or after) the call for which when(call_number, args) is true."""
    original, calls = getattr(owner, name), [0]

    def wrapper(*args, **kwargs):
        calls[0] += 1
        hit = when(calls[0], args)
        if hit and before:
            die()
        out = original(*args, **kwargs)
        if hit:
            die()
        return out

    setattr(owner, name, wrapper)


def at_ckpt10(call, args):
    return any("checkpoint-10" in str(a) for a in args)


def counting(n):
    return lambda call, args: call == n


def hook_model(kind: str, n: int):
    """Forward / backward of the llm: kill at its n-th call (micro-steps: 2 per step)."""
    original, calls = OmniModel.__init__, [0]

    def init(self, *args, **kwargs):
        original(self, *args, **kwargs)

        def hit(*_):
            calls[0] += 1
            if calls[0] == n:
                die()

        if kind == "forward":
            self.llm.register_forward_hook(hit)
        else:
            self.projector.register_full_backward_pre_hook(hit)

    OmniModel.__init__ = init


def rotation_cut_short():
    import shutil

    original = shutil.rmtree

    def rmtree(path, *args, **kwargs):
        if os.path.basename(str(path)) == "checkpoint-5":  # rotation deleting it (not a save clearing a state/)
            victim = os.path.join(path, "llm", "model.safetensors")  # part of the old checkpoint goes, then the kill
            if os.path.exists(victim):
                os.remove(victim)
            die()
        return original(path, *args, **kwargs)

    shutil.rmtree = rmtree


def in_writer_thread_of_ckpt10():
    """SIGKILL at the first tensor the background thread copies for checkpoint-10 (the loop has gone on)."""
    import threading

    saving, original = [None], ModuleCheckpointer.save

    def save(self, directory, *args, **kwargs):
        saving[0] = directory
        return original(self, directory, *args, **kwargs)

    ModuleCheckpointer.save = save
    kill_on_call(async_save_module, "copy_to_cpu", lambda call, args: "checkpoint-10" in str(saving[0])
                 and threading.current_thread().name.startswith("hf_omni_save"))


def marker_tmp_then_kill():
    def write_marker(directory, info, *name):
        if "checkpoint-10" in directory:
            with open(os.path.join(directory, marker.MARKER + ".tmp"), "w") as f:
                f.write('{"partial": ')
            die()
        return original(directory, info, *name)

    original = marker.write_marker
    marker.write_marker = write_marker


POINTS = {
    "forward": (lambda: hook_model("forward", 13), {}),
    "backward": (lambda: hook_model("backward", 14), {}),
    # after the first module's optimizer stepped in step 7 (two AdamW steps a training step)
    "optimizer_step": (lambda: kill_on_call(torch.optim.AdamW, "step", counting(13), before=False), {}),
    "hf_files_first_module": (lambda: kill_on_call(module_io, "write_module_folder", at_ckpt10), {}),
    "hf_files_after_module": (lambda: kill_on_call(module_io, "write_module_folder", at_ckpt10, before=False), {}),
    "optimizer_json": (lambda: kill_on_call(module_state, "save_json", at_ckpt10), {}),
    "scheduler": (lambda: kill_on_call(module_state, "save_scheduler", at_ckpt10), {}),
    "dcp_shards": (lambda: kill_on_call(module_state, "save_state_tensors", at_ckpt10), {}),
    "dcp_shards_written": (lambda: kill_on_call(module_state, "save_state_tensors", at_ckpt10, before=False), {}),
    "root_config": (lambda: kill_on_call(plain.PlainComposition, "write_root", at_ckpt10), {}),
    "rng": (lambda: kill_on_call(OmniTrainer, "_save_rng_state", at_ckpt10), {}),
    "trainer_state": (lambda: kill_on_call(TrainerState, "save_to_json", at_ckpt10), {}),
    "marker_temp_file": (marker_tmp_then_kill, {}),
    "marker_renamed": (lambda: kill_on_call(marker, "write_marker", at_ckpt10, before=False), {}),
    "rotation": (rotation_cut_short, {}),
    "frozen_source_first_save": (
        lambda: kill_on_call(module_io, "write_module_folder", lambda c, a: "frozen" in str(a)), {}),
    # the LoRA base (written once, at the first save): its files written, its marker not yet
    "lora_base_before_marker": (lambda: kill_on_call(bases, "write_marker", lambda c, a: "frozen" in str(a[0])), {}),
    "async_in_flight": (lambda: kill_on_call(module_io.Files, "write",  # in the writer process
                                             lambda call, args: "checkpoint-10" in args[0].folder),
                        {"save_async": True}),
    "async_staging": (in_writer_thread_of_ckpt10, {"save_async": True}),
    "async_shards_in_flight": (lambda: kill_on_call(writer_process, "write_shard_file",  # in the writer process
                                                    lambda call, args: "checkpoint-10" in str(args[0])),
                               {"save_async": True}),
    "async_before_marker": (lambda: kill_on_call(marker, "write_marker", at_ckpt10), {"save_async": True}),
}


def in_child(fn) -> int:
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            fn()
        except BaseException:  # noqa: BLE001 - reported through the exit code
            import traceback

            traceback.print_exc()
            code = 1
        os._exit(code if code else 3)  # 3: ran to the end without being killed
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


def state_of(trainer) -> dict:
    return {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}


def main(out_dir: str):
    results = {}

    def straight():
        trainer = make_trainer(os.path.join(out_dir, "straight"))
        trainer.train()
        torch.save(state_of(trainer), os.path.join(out_dir, "straight.pt"))
        os._exit(0)

    assert in_child(straight) == 0
    for point, (arm, extra) in POINTS.items():
        run = os.path.join(out_dir, point)

        def killed():
            arm()
            make_trainer(run, **extra).train()

        killed_code = in_child(killed)
        complete = [os.path.basename(p) for p in marker.complete_checkpoints(run)]
        checked = []
        for path in marker.complete_checkpoints(run):  # a marker never stands beside missing or partial files
            contents.check_complete(path)
            checked.append(os.path.basename(path))

        def resumed():
            trainer = make_trainer(run, seed=3 if complete else 0, **extra)  # no checkpoint: a restart
            trainer.train(resume_from_checkpoint=True if complete else None)
            torch.save({"state": state_of(trainer), "step": trainer.state.global_step},
                        os.path.join(out_dir, f"{point}.pt"))
            os._exit(0)

        results[point] = {"killed": killed_code, "complete_after_kill": complete, "checked": checked,
                          "resume": in_child(resumed)}

    def export_killed():
        kill_on_call(plain, "copy_module_folder", counting(2), before=False)  # after two of the modules
        hf_omni.cli.export(os.path.join(out_dir, "straight", "checkpoint-15"), os.path.join(out_dir, "export"))

    results["export"] = {"killed": in_child(export_killed),
                         "out_exists": os.path.exists(os.path.join(out_dir, "export")),
                         "partial_left": os.path.isdir(os.path.join(out_dir, ".export.partial"))}

    def export_again():
        hf_omni.cli.export(os.path.join(out_dir, "straight", "checkpoint-15"), os.path.join(out_dir, "export"))
        os._exit(0)

    results["export"]["rerun"] = in_child(export_again)
    torch.save(results, os.path.join(out_dir, "results.pt"))


if __name__ == "__main__":
    main(sys.argv[1])
