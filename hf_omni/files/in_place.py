"""Writing bytes into a module folder's files in place: `Files` (open descriptors, `pwrite` at offsets, never
truncated) and `write_tensor` (one tensor's rows, converted to the file's dtype one 64 MB piece at a time)."""

from __future__ import annotations

import os

import torch

PIECE = 64 * 2**20  # bytes converted and written at a time


def as_bytes(tensor: torch.Tensor, dtype: torch.dtype):
    piece = tensor.detach().to("cpu", dtype).contiguous().reshape(-1)
    return piece.view(torch.uint8).numpy()


class Files:
    """Open file descriptors of a folder's files (created, never truncated), written with `pwrite`."""

    def __init__(self, folder: str):
        self.folder, self.fds = folder, {}

    def write(self, name: str, offset: int, data) -> None:
        if name not in self.fds:
            os.makedirs(self.folder, exist_ok=True)
            self.fds[name] = os.open(os.path.join(self.folder, name), os.O_WRONLY | os.O_CREAT, 0o644)
        view, done = memoryview(data).cast("B"), 0
        while done < len(view):
            done += os.pwrite(self.fds[name], view[done:], offset + done)

    def close(self) -> None:
        for fd in self.fds.values():
            os.fsync(fd)
            os.close(fd)
        self.fds = {}


def write_tensor(files: Files, name: str, offset: int, tensor: torch.Tensor, target: torch.dtype) -> None:
    """`tensor` (rows of a file tensor, or a scalar) at `offset` of file `name`, in dtype `target`, one piece of at
    most PIECE bytes converted at a time."""
    if tensor.ndim == 0:
        return files.write(name, offset, as_bytes(tensor, target))
    row_bytes = tensor[0].numel() * target.itemsize
    rows = max(1, PIECE // max(1, row_bytes))
    for start in range(0, tensor.shape[0], rows):
        files.write(name, offset + start * row_bytes, as_bytes(tensor[start:start + rows], target))
