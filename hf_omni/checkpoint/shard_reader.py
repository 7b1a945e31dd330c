"""`ShardReader`: DCP's `HuggingFaceStorageReader` whose metadata is read by one rank and sent to the others.

Why: DCP asks every rank of a load for the metadata, and torch's reader builds it by opening every shard file of
`state/` and reading its header: at 512 ranks with two files per rank, 1,024 opens on every rank, about half a
million on the shared file system per module and resume. Here rank 0 of the load's process group reads the headers
once and broadcasts the metadata (one object collective; the bytes each rank receives are about those of the
headers it no longer reads), so a rank then opens only the files its own reads touch. An error reading them is
sent instead and raised on every rank. `metadata`: what an earlier reader of the same `state/` returned in this
resume (`resume.load` reads each module's once and hands it to every later reader): no header read, no broadcast.
"""

from __future__ import annotations

from torch.distributed.checkpoint import HuggingFaceStorageReader


class ShardReader(HuggingFaceStorageReader):
    """`group`: the process group of the DCP load (None: the default group); `alone`: a load by one process;
    `metadata`: this `state/`'s metadata, already read (torch's reader keeps no other state from reading it)."""

    def __init__(self, path: str, group=None, alone: bool = False, metadata=None):
        super().__init__(path)
        self.group, self.alone, self.metadata = group, alone, metadata

    def read_metadata(self):
        import torch.distributed as dist

        if self.metadata is not None:
            return self.metadata
        if self.alone or not dist.is_available() or not dist.is_initialized():
            return super().read_metadata()
        sent, source = [None], dist.get_global_rank(self.group, 0) if self.group is not None else 0
        if dist.get_rank(self.group) == 0:
            try:
                sent = [("ok", super().read_metadata())]
            except Exception as err:  # sent first, so that every rank raises it and none waits in the broadcast
                dist.broadcast_object_list([("error", f"{type(err).__name__}: {err}")], src=source, group=self.group)
                raise
        dist.broadcast_object_list(sent, src=source, group=self.group)
        kind, value = sent[0]
        if kind == "error":
            raise RuntimeError(f"reading the shard headers of {self.path} on rank {source}: {value}")
        return value
