"""The one place that asks torch.distributed about the process group: rank, world size, barrier.

No process group (plain `python`, or `accelerate launch` with one process) means rank 0 of a world of 1.
"""

from __future__ import annotations

import torch.distributed as dist


def has_process_group() -> bool:
    """`torchrun` / `accelerate launch --multi_gpu` make one (world size 1 included); plain `python` does not."""
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    return dist.get_rank() if has_process_group() else 0


def world_size() -> int:
    return dist.get_world_size() if has_process_group() else 1


def is_main() -> bool:
    return rank() == 0


def barrier() -> None:
    if has_process_group():
        dist.barrier()
