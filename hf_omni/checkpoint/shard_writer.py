"""`ShardWriter`: DCP's `HuggingFaceStorageWriter` with a streaming write path.

Why: torch's writer builds each shard file in memory (`safetensors.torch.save` returns one `bytes` of the whole
shard) before writing it: a copy of the whole optimizer state and 2-4x the write time measured here
(bench/checkpoint.py). This one writes the same files (a safetensors header carrying DCP's shard offsets, then
each tensor's bytes straight from its memory), optionally split over several files written by parallel threads,
optionally with O_DIRECT. `torch.distributed.checkpoint.HuggingFaceStorageReader` reads them back, resharding at
another world size; nothing in them is pickled.
"""

from __future__ import annotations

import errno
import json
import mmap
import os
import struct
from concurrent.futures import ThreadPoolExecutor

import torch
from torch.distributed.checkpoint import HuggingFaceStorageWriter
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from ..compat import dcp_shard_index, dcp_sharding_info_key
from ..core.dtypes import SAFETENSORS

BLOCK = 4096  # O_DIRECT alignment
BOUNCE = 16 << 20  # O_DIRECT: bytes staged in one aligned buffer per write


def raw_bytes(tensor: torch.Tensor) -> memoryview:
    """The tensor's bytes without a copy (a CPU, contiguous tensor); any dtype."""
    flat = tensor.detach().cpu().contiguous().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy()) if flat.numel() else memoryview(b"")


def header(items: list[tuple[str, torch.Tensor, list[int]]]) -> bytes:
    """A safetensors header (8-byte length, JSON padded to 8 bytes) for tensors written in this order."""
    entries, offset = {}, 0
    for name, tensor, _ in items:
        if tensor.dtype not in SAFETENSORS:
            raise TypeError(f"state tensor {name}: dtype {tensor.dtype} has no safetensors name")
        size = tensor.numel() * tensor.element_size()
        entries[name] = {"dtype": SAFETENSORS[tensor.dtype], "shape": list(tensor.shape),
                         "data_offsets": [offset, offset + size]}
        offset += size
    sharding = {name: {"saved_offsets": offsets} for name, _, offsets in items}
    entries["__metadata__"] = {dcp_sharding_info_key(): json.dumps(sharding), "DCP_VERSION": "1.0", "format": "pt"}
    text = json.dumps(entries, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


def write_buffered(path: str, pieces) -> None:
    with open(path, "wb") as f:
        for piece in pieces:
            f.write(piece)
        f.flush()
        os.fsync(f.fileno())


def write_direct(path: str, pieces) -> None:
    """O_DIRECT (no page cache) through one aligned bounce buffer; the padding of the last block is cut off."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o644)
    except OSError as err:  # tmpfs and some network filesystems refuse O_DIRECT
        if err.errno != errno.EINVAL:
            raise
        return write_buffered(path, pieces)
    buffer, filled, total = mmap.mmap(-1, BOUNCE), 0, 0
    try:
        for piece in pieces:
            piece = memoryview(piece).cast("B")
            while len(piece):
                take = min(len(piece), BOUNCE - filled)
                buffer[filled:filled + take] = piece[:take]
                filled, piece, total = filled + take, piece[take:], total + take
                if filled == BOUNCE:
                    os.write(fd, buffer)
                    filled = 0
        if filled:
            os.write(fd, memoryview(buffer)[:filled + (-filled % BLOCK)])
        os.ftruncate(fd, total)
        os.fsync(fd)
    finally:
        os.close(fd)
        buffer.close()


class ShardWriter(HuggingFaceStorageWriter):
    """Every rank writes its own shard files (`save_distributed`); `threads` files per rank, balanced by size, each
    written by its own thread; `direct`: O_DIRECT where the filesystem allows it."""

    def __init__(self, path: str, threads: int = 1, direct: bool = False):
        super().__init__(path, save_distributed=True)
        self.threads, self.direct = max(1, threads), direct

    def write_data(self, plan, planner) -> Future:
        for item in plan.items:
            if item.tensor_data is None:
                raise TypeError(f"{self.path}: {item.index.fqn} is not a tensor (only tensors go into state shards)")
        items = sorted(plan.items, key=lambda i: -i.tensor_data.size.numel())
        bins: list[list] = [[] for _ in range(min(self.threads, len(items)) or 1)]
        sizes = [0] * len(bins)
        for item in items:  # greedy: the largest item into the emptiest file
            at = sizes.index(min(sizes))
            bins[at].append(item)
            sizes[at] += item.tensor_data.size.numel()
        rank = dcp_shard_index(plan)
        names = [f"shard-{rank:05d}-{i + 1:05d}-of-{len(bins):05d}.safetensors" for i in range(len(bins))]

        def write(name: str, file_items: list) -> list[WriteResult]:
            tensors = [(i.index.fqn, planner.resolve_data(i), list(i.tensor_data.chunk.offsets)) for i in file_items]
            pieces = [header(tensors)] + [raw_bytes(t) for _, t, _ in tensors]
            (write_direct if self.direct else write_buffered)(os.path.join(self.path, name), pieces)
            return [WriteResult(index=i.index, size_in_bytes=t.numel() * t.element_size(), storage_data=name)
                    for i, (_, t, _) in zip(file_items, tensors)]

        future: Future = Future()
        if not items:
            future.set_result([])
            return future
        with ThreadPoolExecutor(len(bins)) as pool:
            results = list(pool.map(write, names, bins))
        future.set_result([r for rs in results for r in rs])
        return future
