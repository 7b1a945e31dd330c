"""`ModuleDims`: one module's parallel dimensions (torchtitan's `ParallelDims`, but one per module), built from its
`parallelism` entry and the registered layouts' declarations (`layout.Layout`), and the run's meshes (`Meshes`).

The data dims are Accelerate's `ParallelismConfig` ones: `{dp_shard_size: S}` shards over S ranks (the default: the
whole world), `{dp_replicate_size: R, dp_shard_size: S}` is HSDP. Each registered layout adds its `<name>_size`: a
layout with a dim multiplies the world (R x S x each dim's size = world size: every module's mesh spans every rank)
and sits where it declares (`layout.ROLES`); one without a dim divides what it declares and builds a mesh of its
own. Every rule is checked once, when the entry is parsed (the world size: at `prepare`), naming the module and
key. A replicate-only entry is `parallel: ddp`'s job. Meshes are built once per distinct shape and dim names, on
every rank in the same order, and shared between modules."""

from __future__ import annotations

import dataclasses
import math

from ..compat import flatten_mesh, group_options
from ..core.dist import has_process_group, world_size
from ..core.errors import OmniArgumentError
from ..core.refusals import RESOLVED, refusal
from .layout import LAYOUTS, ROLES, Layout

REPLICATE, SHARD = "dp_replicate", "dp_shard"
DATA_KEYS = (f"{REPLICATE}_size", f"{SHARD}_size")


def known_keys() -> tuple[str, ...]:
    return (*DATA_KEYS, *(cls.size_key for cls in LAYOUTS))


def parallelism_config_sizes() -> tuple[str, ...]:
    """The size fields of Accelerate's `ParallelismConfig` (its `*_size` fields)."""
    from accelerate.utils import ParallelismConfig

    return tuple(f.name for f in dataclasses.fields(ParallelismConfig) if f.name.endswith("size"))


@dataclasses.dataclass
class ModuleDims:
    """Every dimension's size of one module (1 where unset), checked; `world`: the world size, once known."""

    module: str | None
    sizes: dict[str, int]
    world: int | None = None

    @classmethod
    def parse(cls, module: str | None, entry: dict | None, world: int | None = None) -> "ModuleDims":
        entry = dict(entry or {})
        check_values(module, entry)
        dims = cls(module, {**dict.fromkeys(known_keys(), 1), **entry}, world)
        dims.check_rules()
        if world is not None and entry:
            dims.check_world()
        return dims

    def size(self, key: str) -> int:
        return self.sizes.get(key, 1)

    @property
    def layouts(self) -> list[type[Layout]]:
        """The layouts it asks for (a size above 1), in registry order."""
        return [cls for cls in LAYOUTS if self.size(cls.size_key) > 1]

    def layouts_of(self, meshes=None) -> list[Layout]:
        return [cls(self.module, self.sizes, meshes) for cls in self.layouts]

    def refuse(self, key: str, why: str) -> OmniArgumentError:
        return OmniArgumentError(self.module, f"parallelism.{key}" if key else "parallelism", why)

    def check_rules(self) -> None:
        """The layouts' exclusions and divisibility, and the data dims' own rule."""
        for cls in self.layouts:
            other = next((o for o in self.layouts if o.size_key in cls.excludes), None)
            if other is not None:
                raise self.refuse(cls.size_key, f"{both(cls.description, other.description)} in one module are not "
                                  f"supported: use {cls.size_key} with dp_shard_size (and dp_replicate_size) only")
            for key in cls.multiple_of:
                if self.size(cls.size_key) % self.size(key):
                    raise self.refuse(cls.size_key, f"must be a multiple of {key} = {self.size(key)} "
                                      f"({cls.multiple_of_why}), got {self.size(cls.size_key)}")
            if cls.divides:
                product = math.prod(self.size(k) for k in cls.divides)
                if product % self.size(cls.size_key):
                    raise self.refuse(cls.size_key, f"must divide {' x '.join(cls.divides)} = {product} "
                                      f"({cls.divides_why}), got {self.size(cls.size_key)}")
        if self.size(DATA_KEYS[0]) > 1 and self.size(DATA_KEYS[1]) == 1:
            raise self.refuse(DATA_KEYS[1], "replicas without sharding are plain data parallelism: use `parallel: "
                              "ddp` (as Accelerate's ParallelismConfig says)")

    @property
    def world_keys(self) -> list[str]:
        """The sizes whose product is the world size: the data dims and each layout with a dim it asks for."""
        return [*DATA_KEYS, *(cls.size_key for cls in self.layouts if cls.dim is not None)]

    def check_world(self) -> None:
        keys = self.world_keys
        product = math.prod(self.size(k) for k in keys)
        if product != self.world:
            raise self.refuse("", f"{' x '.join(keys)} = {' x '.join(str(self.size(k)) for k in keys)} = {product}, "
                              f"but the world size is {self.world}: they must be equal (every module's mesh spans "
                              "every rank, as Accelerate's ParallelismConfig requires)")

    # -- the module's mesh ------------------------------------------------------------------------
    def _dims(self, role: str) -> list[str]:
        return [cls.name for cls in self.layouts if cls.dim == role]

    @property
    def replicate_dims(self) -> list[str]:
        return ([REPLICATE] if self.size(DATA_KEYS[0]) > 1 else []) + self._dims("replicate")

    @property
    def shard_dims(self) -> list[str]:
        return [SHARD, *self._dims("shard")]

    @property
    def names(self) -> tuple[str, ...]:
        """The mesh's dim names, outermost first: the replicate dims, the shard dims, then the layouts' own."""
        return (*self.replicate_dims, *self.shard_dims, *self._dims("model"))

    @property
    def shape(self) -> tuple[int, ...]:
        """The mesh's shape at this world size (no entry: `(world,)`, full shard)."""
        if self.world is not None and all(v == 1 for v in self.sizes.values()):
            return (self.world,)
        key = {REPLICATE: DATA_KEYS[0], SHARD: DATA_KEYS[1]}
        return tuple(self.size(key.get(name, f"{name}_size")) for name in self.names)

    def mesh(self, meshes: "Meshes"):
        return meshes.get(self.shape, self.names)

    def data_mesh(self, mesh):
        """What FSDP2 shards over: the mesh without the layouts' own dims, its replicate dims and its shard dims each
        flattened into one (HSDP's 2-D mesh)."""
        if len(self.names) == 1 or not (self._dims("model") or len(self.replicate_dims) > 1 or
                                        len(self.shard_dims) > 1):
            return mesh
        groups = [names for names in (self.replicate_dims, self.shard_dims) if names]
        flat = [names[0] if len(names) == 1 else flatten_mesh(mesh, tuple(names)) for names in groups]
        return mesh[tuple(flat) if len(flat) > 1 else flat[0]]


def both(first: str, second: str) -> str:
    """"expert and tensor parallelism" for "expert parallelism" and "tensor parallelism"."""
    head, _, last = first.rpartition(" ")
    return f"{head} and {second}" if head and second.endswith(" " + last) else f"{first} and {second}"


NOT_SERVED = {  # fields of Accelerate's ParallelismConfig no layout serves yet, and why
    "cp_size": "context parallelism (ring attention) is not served per module yet: torch's `context_parallel` has "
               "no CPU SDPA sharding rule (`aten._scaled_dot_product_flash_attention_for_cpu`) and diffusers' ring "
               "attention needs a backend that returns the log-sum-exp (its `native` one does not), so neither runs "
               "where it can be tested; use sp_size (Ulysses) for long sequences, diffusers modules included",
}


def check_values(module: str | None, entry: dict) -> None:
    """Each key known and each size an integer >= 1. A field of Accelerate's `ParallelismConfig` no layout serves
    yet is accepted at 1 and refused above it, naming what is."""
    registered = known_keys()
    for key, size in entry.items():
        if key not in registered and key not in parallelism_config_sizes():
            raise OmniArgumentError(module, f"parallelism.{key}", f"unknown key; known: {list(registered)}")
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise OmniArgumentError(module, f"parallelism.{key}", f"must be an integer >= 1, got {size!r}")
        if key not in registered and size > 1:
            raise OmniArgumentError(module, f"parallelism.{key}", NOT_SERVED.get(key, "a field of Accelerate's "
                                    "ParallelismConfig that no per-module layout serves in hf_omni") +
                                    "; registered: " + ", ".join(registered))


@refusal(RESOLVED)
def refuse_layouts_the_modules_cannot_take(model, args) -> None:
    """Under a process group, at `OmniTrainer(...)` / `OmniPlugin.resolve`: each module's `parallelism` against the
    world size, and each layout it asks for against the module (its plan, its heads, its experts)."""
    if not has_process_group() or args.fsdp_scope == "model":
        return
    for name, slot in model.slots.items():
        margs = slot.args
        if margs.strategy.takes_mesh and (margs.trainable or margs.parallel_from_module):
            for layout in ModuleDims.parse(name, margs.parallelism, world_size()).layouts_of():
                layout.check(slot.module)


def check_parallelism(module: str | None, value: dict) -> None:
    """Parse-time checks of a `parallelism` entry (the world size is checked at `prepare`)."""
    ModuleDims.parse(module, value)


def mesh_shape(module: str | None, entry: dict | None, world: int) -> tuple[int, ...]:
    return ModuleDims.parse(module, entry, world).shape


def dim_names(entry: dict | None, ndim: int | None = None) -> tuple[str, ...]:
    return ModuleDims.parse(None, entry).names


def role_table() -> list[str]:
    """docs/parallel.md's table of the `parallelism` keys, generated from the data dims and the declaration of each
    layout hf_omni ships."""
    rows = ["| key | what it is | mesh dim | rule | not with | LoRA | boundary |", "|---|---|---|---|---|---|---|"]
    rows += [f"| `{DATA_KEYS[0]}` | replicas (HSDP: with `dp_shard_size`) | `{REPLICATE}`, outermost | multiplies "
             "the world size | - | yes | - |",
             f"| `{DATA_KEYS[1]}` | FSDP2's shard group (default: the world) | `{SHARD}` | multiplies the world size "
             "| - "
             "| yes | - |"]
    for cls in LAYOUTS.own():
        where = f"`{cls.name}`, {ROLES[cls.dim].split(':')[0]}" if cls.dim else "a mesh of its own"
        rule = ("multiplies the world size" if cls.dim else f"divides {' x '.join(cls.divides)}") + \
            "".join(f", a multiple of {k}" for k in cls.multiple_of) + f"; `parallel: {' | '.join(cls.strategies)}`"
        lora = "no: " + cls.lora if cls.lora else cls.lora_terms or "yes"
        rows.append(f"| `{cls.size_key}` | {cls.description} | {where} | {rule} | "
                    f"{', '.join(f'`{k}`' for k in cls.excludes) or '-'} | {lora} | {cls.boundary or '-'} |")
    return rows


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

        names = names or (REPLICATE, SHARD)[-len(shape):]
        if (shape, names) not in self.by_shape:
            override = group_options(self.device_type, self.timeout_s) if self.timeout_s and len(shape) > 1 else None
            kwargs = {"backend_override": dict.fromkeys(range(len(shape)), override)} if override else {}
            self.by_shape[shape, names] = init_device_mesh(self.device_type, shape, mesh_dim_names=names, **kwargs)
        return self.by_shape[shape, names]
