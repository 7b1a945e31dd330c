"""The one place that asks torch.distributed about the process group: rank, world size, barrier, and the
agreement on success after a step some ranks did on their own.

No process group (plain `python`, or `accelerate launch` with one process) means rank 0 of a world of 1.
"""

from __future__ import annotations

import contextlib

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


class RankFailure(RuntimeError):
    """A step that some ranks did on their own failed: every rank raises this, naming the rank and the step."""


def broadcast_from_main(value, group=None):
    """Rank 0's `value` on every rank (a small picklable object; `group` holds every rank)."""
    objects = [value]
    if has_process_group():
        dist.broadcast_object_list(objects, src=0, group=group)
    return objects[0]


def default_group_timeout(timeout_s: float | None) -> None:
    """The default group's timeout becomes `timeout_s` (`ddp_timeout`): Trainer passes
    `ddp_timeout` to the process group it makes except under `use_cpu`, and a custom loop's group has whatever its
    Accelerator was given. One setting per process, no collective."""
    if has_process_group() and timeout_s:
        from ..compat import set_group_timeout

        set_group_timeout(dist.group.WORLD, timeout_s)


_SIDE_GROUPS: dict = {}  # thread -> (the default group it was made under, the gloo group)


def checkpoint_group(timeout_s: float | None = None, thread: str = "main"):
    """hf_omni's gloo group for agreements and small objects beside training's collectives (CPU objects, whatever
    backend training uses): one per thread that issues them — "main" (checkpoint agreement, offline caches) and
    "writer" (the async save thread), so two threads never share a group — made once per process group, with
    `timeout_s` (`ddp_timeout`) as its timeout. Every rank must call this in the same order; None without a
    process group. Each costs world - 1 sockets per rank once connected (docs/parallel.md)."""
    if not has_process_group():
        return None
    made = _SIDE_GROUPS.get(thread)
    if made is None or made[0] is not dist.group.WORLD:
        import datetime

        timeout = {"timeout": datetime.timedelta(seconds=timeout_s)} if timeout_s else {}
        made = _SIDE_GROUPS[thread] = (dist.group.WORLD, dist.new_group(backend="gloo", **timeout))
    return made[1]


def all_gather_host(rows: list[list[int]], group) -> list[list[list[int]]]:
    """Every rank's small table of integers (the same shape on every rank), over `group` (hf_omni's gloo side group,
    or a `host_group`): built on the host, gathered, and read back as Python ints in one `tolist()`. The one way
    hf_omni moves per-step metadata (who has which input, shapes, dtypes, errors): no device memory is read on the
    host."""
    import torch

    size = dist.get_world_size(group)
    mine = torch.tensor(rows, dtype=torch.int64)
    everyone = torch.empty((size * mine.shape[0], *mine.shape[1:]), dtype=torch.int64)
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # the newer name, where it is
    gather(everyone, mine, group=group)
    return everyone.view(size, *mine.shape).tolist()


_HOST_GROUPS: dict = {}  # (the default group, every group's ranks) -> this rank's gloo group among them


def host_group(mesh, dim: str):
    """A gloo group over this rank's group along `dim` of `mesh`, for the host integers a split module's boundary
    exchanges at each call (`all_gather_host`): the mesh's own group where it is gloo already (a CPU mesh), else one
    made for every group along `dim` (every rank calls this in the same order; each rank connects to its group's
    N - 1 others: N - 1 sockets)."""
    if mesh.device_type == "cpu":
        return mesh[dim].get_group()
    i = mesh.mesh_dim_names.index(dim)
    groups = tuple(tuple(g) for g in mesh.mesh.movedim(i, -1).reshape(-1, mesh.mesh.shape[i]).tolist())
    key = (dist.group.WORLD, groups)
    if key not in _HOST_GROUPS:
        _HOST_GROUPS[key] = dist.new_subgroups_by_enumeration([list(g) for g in groups], backend="gloo")[0]
    return _HOST_GROUPS[key]


def share_failure(error: BaseException | None, what: str, group) -> None:
    """After `what`, which ranks did on their own: all learn whether any failed, and all raise the same
    `RankFailure` naming the first rank that did (instead of some ranks waiting in the next collective)."""
    message = None if error is None else f"{type(error).__name__}: {error}"
    everyone = [message]
    if has_process_group():
        everyone = [None] * world_size()
        dist.all_gather_object(everyone, message, group=group)
    failed = [(r, m) for r, m in enumerate(everyone) if m is not None]
    if failed:
        failed_rank, failed_message = failed[0]
        raise RankFailure(f"{what} failed on rank {failed_rank}: {failed_message}") from error


@contextlib.contextmanager
def agreed(what: str, group):
    """Run a block that ranks do on their own, then agree on its success (`share_failure`). Without a process
    group the block's own error is raised as it is."""
    try:
        yield
    except Exception as err:  # shared with every rank, which all raise
        if has_process_group():
            share_failure(err, what, group)
        raise
    share_failure(None, what, group)
