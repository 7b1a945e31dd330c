"""Launching scripts from the tests: N gloo ranks with `accelerate launch`, the environment a launched script gets
(the tests' folder on its import path), free ports."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys

TESTS = os.path.dirname(os.path.abspath(__file__))
SCRIPTS = os.path.join(TESTS, "scripts")


def subprocess_env(**extra) -> dict:
    """The environment of a launched script: no Accelerate or FSDP settings of the caller's, the tests' folder on
    the import path."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ACCELERATE_", "FSDP_"))}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (TESTS, env.get("PYTHONPATH")) if p)
    return env | extra


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(script: str, *args: str, processes: int = 2, timeout: int = 600, env_extra: dict | None = None) -> None:
    """`accelerate launch --multi_gpu --num_processes N tests/scripts/SCRIPT ARGS` (gloo on CPU), failing loudly with
    the end of its output."""
    cmd = ["accelerate", "launch", "--multi_gpu", "--num_processes", str(processes), "--num_machines", "1",
           "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", str(free_port()),
           os.path.join(SCRIPTS, script), *args]
    process = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               env=subprocess_env(**(env_extra or {})), start_new_session=True)
    try:
        out, err = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:  # the ranks and their children too, not only the launcher
        os.killpg(process.pid, signal.SIGKILL)
        out, err = process.communicate()
        sys.stderr.write(out[-6000:] + err[-12000:])
        raise AssertionError(f"{script} timed out after {timeout} s at {processes} ranks (its process group killed)")
    result = subprocess.CompletedProcess(cmd, process.returncode, out, err)
    if result.returncode != 0:
        sys.stderr.write(result.stdout[-6000:] + result.stderr[-12000:])
        raise AssertionError(f"{script} failed at {processes} ranks (exit {result.returncode})")


def end_distributed(code: int = 0) -> None:
    """Ends a launched script: its process groups destroyed (as torch asks of every program), then the process left
    with `os._exit(CODE)`, skipping the interpreter's teardown. There gloo's threads and work objects are freed in
    no set order, and a rank aborts now and then (SIGABRT, "terminate called without an active exception", seen
    with and without the destroy) instead of exiting with CODE. Only for a point every rank reaches (success, or an
    error every rank raised): a rank that destroys while another is still in a collective would wait for it. What
    the script wrote is flushed first."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
