"""Per-module device meshes for `parallel: fsdp` modules, set by a module's `parallelism` entry with the field
names and rules of Accelerate's `ParallelismConfig`: `{dp_shard_size: N}` shards over N ranks (the default: the
whole world); `{dp_replicate_size: R, dp_shard_size: S}` is HSDP (`fully_shard` on an R x S mesh: shards within
groups of S ranks, replicas across them); `tp_size: T` adds tensor parallelism inside the module (its own
transformers plan, `tensor.py`) on the innermost mesh dim `tp`. R x S x T must equal the world size: every mesh spans
every rank. `ep_size: E` spreads a MoE module's experts over E ranks (`experts.py`) on an expert mesh of the same
ranks; as in transformers' `DistributedConfig` it divides S x T and does not multiply the world size. A
replicate-only entry is `parallel: ddp`'s job; context and sequence parallelism are refused.
Meshes are built once per distinct shape and dim names, on every rank in the same order, and shared between modules."""

from __future__ import annotations

from ..compat import group_options
from ..errors import OmniArgumentError

SIZES = ("dp_replicate_size", "dp_shard_size", "tp_size", "ep_size", "cp_size", "sp_size")
LAYOUT_SIZES = {"tp_size": "tensor parallelism", "ep_size": "expert parallelism"}  # composed under FSDP2, per module
DIM_NAMES = ("dp_replicate", "dp_shard")
TP = "tp"  # the innermost dim of a tensor-parallel module's mesh


def check_parallelism(module: str | None, value: dict) -> None:
    """Parse-time checks of a `parallelism` entry (the world size is checked at `prepare`)."""
    for key, size in value.items():
        if key not in SIZES:
            raise OmniArgumentError(module, f"parallelism.{key}", f"unknown key; known: {list(SIZES)}")
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise OmniArgumentError(module, f"parallelism.{key}", f"must be an integer >= 1, got {size!r}")
        if key in ("cp_size", "sp_size") and size > 1:
            raise OmniArgumentError(module, f"parallelism.{key}", "context and sequence parallelism are not "
                                    "supported per module (they need activations moved between modules); use "
                                    "dp_replicate_size / dp_shard_size / tp_size / ep_size")
    ep, shard, tp = value.get("ep_size", 1), value.get("dp_shard_size", 1), tp_size(value)
    if ep > 1 and tp > 1:
        raise OmniArgumentError(module, "parallelism.ep_size", "expert and tensor parallelism in one module are not "
                                "supported: use ep_size with dp_shard_size (and dp_replicate_size) only")
    if ep > 1 and (shard * tp) % ep:
        raise OmniArgumentError(module, "parallelism.ep_size", f"must divide dp_shard_size x tp_size = {shard * tp} "
                                "(set dp_shard_size: with ep_size the entry names every size) "
                                f"(transformers' DistributedConfig rule: experts are spread inside the shard group, "
                                f"never over more ranks), got {ep}")
    if value.get("dp_replicate_size", 1) > 1 and value.get("dp_shard_size", 1) == 1:
        raise OmniArgumentError(module, "parallelism.dp_shard_size", "replicas without sharding are plain data "
                                "parallelism: use `parallel: ddp` (as Accelerate's ParallelismConfig says)")


def tp_size(value: dict | None) -> int:
    """The tensor-parallel size a `parallelism` entry asks for (1: none)."""
    return (value or {}).get("tp_size", 1)


def layout_keys(value: dict | None) -> list[str]:
    """The sizes of a `parallelism` entry that ask for a layout inside the module (`tp_size`, `ep_size` above 1)."""
    return [key for key in LAYOUT_SIZES if (value or {}).get(key, 1) > 1]


def mesh_shape(module: str, value: dict | None, world: int) -> tuple[int, ...]:
    """The module's mesh shape at this world size: `(S,)` for full shard, `(R, S)` for HSDP, then `T` appended
    with tensor parallelism (`dim_names` names the dims)."""
    if not value:
        return (world,)
    replicate, shard, tp = value.get("dp_replicate_size", 1), value.get("dp_shard_size", 1), tp_size(value)
    if replicate * shard * tp != world:
        raise OmniArgumentError(module, "parallelism", f"dp_replicate_size x dp_shard_size x tp_size = {replicate} x "
                                f"{shard} x {tp} = {replicate * shard * tp}, but the world size is {world}: they must "
                                "be equal (every module's mesh spans every rank, as Accelerate's ParallelismConfig "
                                "requires)")
    return ((shard,) if replicate == 1 else (replicate, shard)) + ((tp,) if tp > 1 else ())


def dim_names(value: dict | None, ndim: int) -> tuple[str, ...]:
    """The dim names of a mesh of `ndim` dims for this `parallelism` entry."""
    data = ndim - (tp_size(value) > 1)
    return DIM_NAMES[len(DIM_NAMES) - data:] + ((TP,) if data < ndim else ())


class Meshes:
    """One `DeviceMesh` per distinct shape, built on first use (every rank asks in the same module order). The groups
    a mesh makes (HSDP's replicate and shard groups) carry `timeout_s` (`ddp_timeout`), not the backend's default
    (NCCL: 10 min, gloo: 30 min); a 1-D mesh is the default group itself, whose timeout is set where it is made
    (Trainer: `ddp_timeout`; a custom loop: Accelerate's `InitProcessGroupKwargs(timeout=...)`)."""

    def __init__(self, device_type: str, timeout_s: float | None = None):
        self.device_type, self.timeout_s = device_type, timeout_s
        self.by_shape: dict[tuple, object] = {}

    def get(self, shape: tuple[int, ...], names: tuple[str, ...] | None = None):
        from torch.distributed.device_mesh import init_device_mesh

        names = names or DIM_NAMES[-len(shape):]
        if (shape, names) not in self.by_shape:
            override = group_options(self.device_type, self.timeout_s) if self.timeout_s and len(shape) > 1 else None
            kwargs = {"backend_override": dict.fromkeys(range(len(shape)), override)} if override else {}
            self.by_shape[shape, names] = init_device_mesh(self.device_type, shape, mesh_dim_names=names, **kwargs)
        return self.by_shape[shape, names]
