"""Counting the bytes hf_omni's and DCP's safetensors readers request, for tests and benchmarks: mmap'ed reads and
the page cache hide them from /proc/self/io, so "is each byte read once?" is answered at the readers."""

from __future__ import annotations

from ..compat import wrap_dcp_hf_read_request
from ..files import weights


def count_reads() -> dict:
    """Wrap the safetensors reads of hf_omni (`SafetensorsIndex.read`) and of DCP's HF reader (each read request's
    tensor slice) for the rest of the process; returns the counter, `{"bytes": n}`, that they add to."""
    import math

    counter = {"bytes": 0}
    read = weights.SafetensorsIndex.read

    def counted_read(self, key, box=None):
        out = read(self, key, box)
        counter["bytes"] += out.numel() * out.element_size()
        return out

    def counted(process):
        def counted_process(self, f, req, planner):
            counter["bytes"] += math.prod(req.lengths) * planner.resolve_tensor(req).element_size()
            return process(self, f, req, planner)

        return counted_process

    weights.SafetensorsIndex.read = counted_read
    wrap_dcp_hf_read_request(counted)
    return counter
