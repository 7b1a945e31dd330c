"""Test helpers that ship with hf_omni (its tests and quickstart notebook use them); nothing here is for real use:
the demos' models and data (`digits`, `digits_t2i`, `digits_omni`), a loopback Hub (`loopback_hub` over
`hub_store`), and counters
of collectives (`collectives`), host reads of device memory (`host_reads`), file reads (`reads`) and FSDP2's
padding at a large world size (`shard_padding`)."""

from .loopback_hub import LoopbackHub

__all__ = ["LoopbackHub"]
