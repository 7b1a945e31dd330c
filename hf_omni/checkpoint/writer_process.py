"""`WriterProcess`: the process that writes an async save's files, so that the training process only stages.

One per rank, forked from the training process's main thread at its first async save. It shares no process group
and opens no socket: it talks to its parent over two pipes (JSON lines of plain data: file names, offsets, buffer names; nothing pickled),
and reads the tensors from the parent's staging buffers, which are shared memory (`staging.Staging`: each buffer
a file in /dev/shm mapped by both, its name sent once, unlinked once both mapped it; reused from save to save, so a
save sends nothing per tensor beyond its buffer name and offset). It writes what the parent planned: an HF folder's
headers and rows at their offsets (`files.in_place`, the export cast done here) and a `state/` shard file's header and
tensors (`shard_plan`). It dies with its parent (PR_SET_PDEATHSIG), and exits when its pipe closes.

Why a process: a writer thread holds the GIL while it runs Python (DCP's planning, the loops over tensors), and the
training loop's kernel launches wait for it (bench/checkpoint.py measures the step time during a background save).
torch's `async_save(async_checkpointer_type=PROCESS)` was not taken: it covers DCP alone, pickles the staged state
dict on every save, and its process joins a gloo group of its own (world - 1 sockets per rank).
"""

from __future__ import annotations

import base64
import ctypes
import json
import os
import signal
import threading
import traceback
from concurrent.futures import ThreadPoolExecutor

import torch

from ..files.in_place import Files, write_tensor

IN_WRITER = False  # true in the writer process (tests that SIGKILL "the run" kill its parent too)
_DTYPES = {str(d): d for d in (torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32,
                               torch.int16, torch.int8, torch.uint8, torch.bool, torch.float8_e4m3fn,
                               torch.float8_e5m2)}


def ref_view(buffers: dict, ref) -> torch.Tensor:
    """The tensor a reference names: (buffer name, byte offset, shape, dtype name) in a mapped buffer."""
    name, offset, shape, dtype = ref
    dtype = _DTYPES[dtype]
    if name is None:
        return torch.empty(shape, dtype=dtype)
    numel = 1
    for size in shape:
        numel *= size
    return buffers[name][offset:offset + numel * dtype.itemsize].view(dtype).view(shape)


def write_folder(buffers: dict, folder: str, heads: list, tensors: list) -> None:
    files = Files(folder)
    try:
        for name, offset, data in heads:
            files.write(name, offset, data)
        for name, offset, ref, target in tensors:
            write_tensor(files, name, offset, ref_view(buffers, ref), _DTYPES[target])
    finally:
        files.close()


def write_shard_file(path: str, head: bytes, tensors: list) -> None:
    """One `state/` shard file: its safetensors header, then each tensor's bytes, fsync'd."""
    with open(path, "wb") as f:
        f.write(head)
        for tensor in tensors:
            if tensor.numel():
                f.write(memoryview(tensor.contiguous().reshape(-1).view(torch.uint8).numpy()))
        f.flush()
        os.fsync(f.fileno())


def write_shards(buffers: dict, state_dir: str, files: list) -> None:
    """A rank's shard files of one `state/`, each by a thread of its own (the first failure raised once all end)."""
    os.makedirs(state_dir, exist_ok=True)
    if files:
        with ThreadPoolExecutor(len(files)) as pool:
            list(pool.map(lambda f: write_shard_file(os.path.join(state_dir, f[0]), f[1],
                                                     [ref_view(buffers, r) for r in f[2]]), files))


def _encode(value):
    if isinstance(value, bytes):
        return {"bytes": base64.b64encode(value).decode()}
    if isinstance(value, (list, tuple, torch.Size)):
        return [_encode(v) for v in value]
    return value


def _decode(value):
    if isinstance(value, dict):
        return base64.b64decode(value["bytes"])
    if isinstance(value, list):
        return [_decode(v) for v in value]
    return value


def send(stream, message) -> None:
    """One message on a pipe: a JSON line (bytes as base64), so neither end ever unpickles what the other sent."""
    stream.write(json.dumps(_encode(message)).encode() + b"\n")
    stream.flush()


def receive(stream):
    line = stream.readline()
    if not line:
        raise EOFError("the pipe closed")
    return _decode(json.loads(line))


class _Failed(Exception):
    """A request that failed in the writer (its text goes back to the parent)."""


def _run(kind: str, payload, buffers: dict) -> None:
    try:
        if kind == "map":
            for name, path, nbytes in payload:
                buffers[name] = torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)
        elif kind == "folder":
            write_folder(buffers, *payload)
        elif kind == "shards":
            write_shards(buffers, *payload)
    except Exception as err:  # every failure goes back to the parent, which names the module and folder
        raise _Failed(f"{type(err).__name__}: {err}") from err


def serve(requests, replies) -> None:
    """The writer's loop: map buffers, write what it is sent, reply after each request."""
    buffers: dict[str, torch.Tensor] = {}
    while True:
        try:
            kind, number, payload = receive(requests)
        except EOFError:
            return
        error = None
        try:
            _run(kind, payload, buffers)
        except _Failed as failed:
            error = str(failed)
        send(replies, (number, error))
        if kind == "stop":
            return


def close_inherited(keep: tuple[int, ...]) -> None:
    """In the writer: every descriptor inherited from the training process but stdio and `keep` closed, so no
    socket of its process groups or store stays open here (nor keeps a peer's connection alive)."""
    for fd in [int(name) for name in os.listdir("/proc/self/fd")]:
        if fd > 2 and fd not in keep:
            try:
                os.close(fd)
            except OSError:  # the listing's own descriptor, gone already
                continue


class WriterError(RuntimeError):
    """A request the writer process failed: its text is the writer's `<type>: <message>`."""


class WriterProcess:
    """The parent's end: `request` sends one request and waits for its reply (from one thread at a time)."""

    def __init__(self):
        child_reads, parent_writes = os.pipe()
        parent_reads, child_writes = os.pipe()
        parent = os.getpid()
        pid = os.fork()  # from the main thread: PR_SET_PDEATHSIG follows the thread that forked
        if pid == 0:  # the writer: no return from here
            global IN_WRITER
            IN_WRITER, code = True, 0
            try:
                ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
                if os.getppid() != parent:
                    os._exit(0)
                close_inherited((child_reads, child_writes))
                torch.set_num_threads(1)  # no OpenMP pool in a forked child
                serve(os.fdopen(child_reads, "rb"), os.fdopen(child_writes, "wb"))
            except BaseException:
                code = 1
                traceback.print_exc()
                raise  # (into the finally: a forked child never returns into the parent's code)
            finally:
                os._exit(code)
        os.close(child_reads), os.close(child_writes)
        self.pid, self.number, self.lock = pid, 0, threading.Lock()
        self.requests, self.replies = os.fdopen(parent_writes, "wb"), os.fdopen(parent_reads, "rb")

    def request(self, kind: str, payload=None) -> None:
        """Send a request and wait for it to be done; its failure raised as a `WriterError` with the writer's text."""
        with self.lock:
            self.number += 1
            try:
                send(self.requests, (kind, self.number, payload))
                number, error = receive(self.replies)
            except (EOFError, BrokenPipeError, OSError) as err:
                raise WriterError(f"the writer process (pid {self.pid}) died: {self.status()}") from err
        if error is not None:
            raise WriterError(error)

    def status(self) -> str:
        try:
            pid, code = os.waitpid(self.pid, os.WNOHANG)
        except ChildProcessError:
            return "gone"
        return "still running" if pid == 0 else f"exit status {code}"

    def close(self) -> None:
        try:
            self.request("stop")
        except WriterError:
            pass  # already gone: nothing left to stop
        self.requests.close(), self.replies.close()
        os.waitpid(self.pid, 0)
