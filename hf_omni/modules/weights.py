"""Reading a module's tensors back in place from its HF folder: every parameter and persistent buffer, a sharded
one as this rank's rows only.

Where each tensor lives in the folder (`file_layout`) is traced, not guessed: meta placeholders of the module's
tensors go through exactly what a save applies (`folder_plan`) (LoRA keys split off, transformers' save-time key
conversion, PEFT's adapter naming), and a tensor whose placeholder comes out under some key, as the same object,
is stored there as is. What the files do not hold as is (MoE experts that transformers splits on save, ...) a
checkpoint keeps in its `state/` (`checkpoint.module_state`); a plain HF folder (`empty_init`, a frozen module's source)
serves fused MoE experts row by row (`expert_rows`: each rank the files of its own experts) and anything else
through transformers' own loading (`read_through_transformers`).

`empty_init` (`fill_module`): a module that will be sharded is sharded first (on meta), then every rank allocates
its own shards and reads just those rows (`get_slice`): no rank holds a full copy, no communication.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from ..compat import has_init_weights, init_lora_layer, init_weights, own_tensors, transformers_save_keys
from .classes import original_class, save_view
from .empty_init import materialize
from .lora import ADAPTER_WEIGHTS, adapter_state_dict, base_key, base_state_dict, has_adapter, lora_config_of
from .lora_base import weights_folder
from .safetensors_index import SafetensorsIndex

logger = logging.getLogger(__name__)
WEIGHTS, ADAPTER = "weights", "adapter"


def module_tensors(module: nn.Module) -> dict[str, torch.Tensor]:
    """Every tensor a module's state is made of: its parameters (tied ones once) and persistent buffers."""
    persistent = set(module.state_dict(keep_vars=True))
    tensors = dict(module.named_parameters())
    tensors.update((n, b) for n, b in module.named_buffers() if n in persistent)
    return tensors


def file_layout(module: nn.Module) -> dict[str, tuple[str, list[str]]]:
    """Tensor name -> (WEIGHTS | ADAPTER, the keys it may be stored under) for each tensor a save writes as
    is; a tied tensor has one key per name it goes by (transformers keeps one of them in the file)."""
    persistent = set(module.state_dict(keep_vars=True))
    owner, placeholders = {}, {}
    for name, t in module_tensors(module).items():
        owner[id(t)] = name
    every = list(module.named_parameters(remove_duplicate=False)) + [
        (n, b) for n, b in module.named_buffers(remove_duplicate=False) if n in persistent]
    made = {}
    for name, t in every:
        if id(t) not in made:
            made[id(t)] = (torch.empty(tuple(t.shape), dtype=t.dtype, device="meta"), owner[id(t)])
        placeholders[name] = made[id(t)][0]
    canonical = {id(ph): name for ph, name in made.values()}
    layout: dict[str, tuple[str, list[str]]] = {}
    for key, t in transformers_save_keys(save_view(module), base_state_dict(placeholders)).items():
        if id(t) in canonical:
            layout.setdefault(canonical[id(t)], (WEIGHTS, []))[1].append(key)
    if lora_config_of(module) is not None:
        for key, t in adapter_state_dict(module, placeholders).items():
            if id(t) in canonical:
                entry = layout.get(canonical[id(t)])
                if entry is None or entry[0] != ADAPTER:
                    entry = layout[canonical[id(t)]] = (ADAPTER, [])
                entry[1].append(key)
    return layout


def local_rows(tensor) -> tuple[int, int] | None:
    """Rows [start, stop) of dim 0 this rank holds of a DTensor sharded on dim 0 (torch.chunk layout) over one
    mesh dimension, replicated over any other (HSDP); None for a plain tensor."""
    if not hasattr(tensor, "to_local"):
        return None
    from torch.distributed.tensor import Replicate, Shard

    sharded = [i for i, p in enumerate(tensor.placements) if isinstance(p, Shard) and p.dim == 0]
    if len(sharded) != 1 or len(sharded) + sum(isinstance(p, Replicate) for p in tensor.placements) != \
            len(tensor.placements):
        raise NotImplementedError(f"hf_omni reads dim-0 shards (replicated elsewhere) only, got {tensor.placements}")
    mesh = tensor.device_mesh
    rank, world = mesh.get_local_rank(sharded[0]), mesh.size(sharded[0])
    full = tensor.shape[0]
    chunk = -(-full // world)
    start = min(rank * chunk, full)
    return start, min(start + chunk, full)


def copy_rows(tensor: torch.Tensor, full_or_rows) -> None:
    """Copy a value into `tensor` in place (a sharded tensor: into its local shard), casting to its dtype."""
    local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
    local.copy_(full_or_rows.to(local.dtype))


def _castable(saved: torch.dtype | None, ours: torch.dtype) -> bool:
    return saved == ours or (saved is not None and saved.is_floating_point and ours.is_floating_point)


@torch.no_grad()
def read_into(module: nn.Module, folder: str, strict: bool = False, module_name: str = "", dry_run: bool = False,
              skip: frozenset[str] = frozenset(), replicated: bool = False) -> list[str]:
    """Copy the tensors `folder`'s HF files hold (LoRA adapter beside them) into `module` in place, cast to each
    tensor's own dtype; a sharded tensor reads only this rank's rows. Shapes (and integer dtypes) must match: the
    error names module and tensor. Returns the tensors the files lack (`strict`: an error); `skip` are read
    elsewhere. Under HSDP the first replica reads and sends; `replicated` (every rank calls this for a module every
    rank holds whole): rank 0 reads and broadcasts (`parallel.replicas.read_once`)."""
    weights = SafetensorsIndex.for_weights(weights_folder(folder))  # a LoRA base written apart: there
    adapter = SafetensorsIndex(folder, [ADAPTER_WEIGHTS]) if has_adapter(folder) else None
    layout = file_layout(module)
    plan, missing = [], []
    for name, tensor in module_tensors(module).items():
        if name in skip:
            continue
        kind, keys = layout.get(name, (None, ()))
        source = adapter if kind == ADAPTER else weights
        key = next((k for k in keys if source is not None and k in source), None)
        if key is None:
            missing.append(name)
            continue
        plan.append((tensor, source, key, name))
    if strict and missing:
        raise ValueError(f"module {module_name!r}: {folder} cannot restore {len(missing)} tensors {missing[:5]}")
    check_shapes(plan, module_name, folder, replicated, agree=not dry_run)
    if not dry_run:
        from ..parallel.replicas import read_once

        read_once([tensor for tensor, *_ in plan], lambda i: copy_rows(plan[i][0], plan[i][1].read(
            plan[i][2], local_rows(plan[i][0]))), f"module {module_name!r}: reading {folder}", replicated)
    return missing


def check_shapes(plan: list, module_name: str, folder: str, replicated: bool, agree: bool = True) -> None:
    """Each (tensor, file index, key, name) of `plan` against its file's header, by the ranks that will read it
    (others open no file for it); when some ranks check less, they all agree on the outcome before reading
    (`agree`; a dry run is inside the caller's own agreement, which nothing may precede on one rank alone)."""
    from ..dist import agreed, checkpoint_group
    from ..parallel.replicas import readers

    mine, split = readers([tensor for tensor, *_ in plan], replicated)

    def check():
        for (tensor, source, key, name), reading in zip(plan, mine):
            if not reading:
                continue
            shape, dtype = source.info(key)
            if shape != tuple(tensor.shape) or not _castable(dtype, tensor.dtype):
                raise ValueError(f"module {module_name!r}: tensor {name} is {tuple(tensor.shape)} {tensor.dtype} in "
                                 f"the model but {shape} {dtype} in {folder}")

    if not split or not agree:  # every rank checks every tensor (they all fail alike), or the caller agrees
        return check()
    with agreed(f"module {module_name!r}: checking {folder}", checkpoint_group()):
        check()


@torch.no_grad()
def read_through_transformers(module: nn.Module, folder: str, names: list[str], module_name: str) -> list[str]:
    """The tensors `names` of `module`, from a plain HF folder through transformers' own loading (its key
    conversion on load: merged MoE experts, ...). Costs one full copy of the module on CPU while it runs; used only
    for tensors the files do not hold as is. Returns the names transformers' model does not have either."""
    dtype = next((t.dtype for t in module.parameters() if t.is_floating_point()), None)
    loaded = original_class(module).from_pretrained(weights_folder(folder), dtype=dtype).state_dict()
    tensors = module_tensors(module)
    left = []
    for name in names:
        value, tensor = loaded.get(base_key(name)), tensors[name]
        if value is None or tuple(value.shape) != tuple(tensor.shape):
            left.append(name)
            continue
        rows = local_rows(tensor)
        copy_rows(tensor, value if rows is None else value[rows[0]:rows[1]])
    logger.info("hf_omni: module %r: %d tensors read through transformers' loading from %s", module_name,
                len(names) - len(left), folder)
    return left


@torch.no_grad()
def fill_module(module: nn.Module, folder: str, device: torch.device, module_name: str = "") -> list[str]:
    """Allocate `module`'s meta tensors on `device` (only the local shards of sharded ones) and read them from the
    HF folder `folder`; returns the names it lacks (initialised by the module instead, with a warning, as
    `from_pretrained` does)."""
    materialize(module, device)  # tied parameters stay one parameter
    move_buffers(module, device)  # computed buffers (rotary tables) move; persistent ones are read below
    missing = read_into(module, folder, module_name=module_name)
    layout = file_layout(module)
    unmapped = [n for n in missing if n not in layout]
    if unmapped:
        from .expert_rows import read_fused_rows

        unmapped = read_fused_rows(module, folder, unmapped, module_name)
        missing = [n for n in missing if n in layout] + (read_through_transformers(module, folder, unmapped,
                                                                                   module_name) if unmapped else [])
    params = dict(module.named_parameters())
    missing = [n for n in missing if n in params]  # a buffer the files lack keeps its constructed value
    unstored = [n for n in missing if ".lora_" not in n]  # a fresh adapter is never in the base files
    if unstored:
        logger.warning("hf_omni: module %r: %s has no stored value for %s; initialised by %s", module_name, folder,
                       unstored, type(getattr(module, "omni_released", module)).__name__)
    if missing:
        _initialise(module, missing)
    return missing


def move_buffers(module: nn.Module, device: torch.device) -> None:
    """Every buffer of `module` onto `device`, in place of the old tensor (hooks and FSDP state keep the module)."""
    for owner in module.modules():
        for table, attr, buf in own_tensors(owner, parameters=False):
            if buf.device != device:
                table[attr] = buf.to(device)


def _initialise(module: nn.Module, names: list[str]) -> None:
    """The module's own initialisation for parameters with no stored value (LoRA layers: their reset)."""
    owners = {name.rsplit(".", 1)[0] if "." in name else "" for name in names}
    lora_layers = {owner.split(".lora_")[0] for owner in owners if ".lora_" in f".{owner}."}
    for layer in sorted(lora_layers):
        init_lora_layer(module.get_submodule(layer), lora_config_of(module))
    model = getattr(module, "omni_released", module)  # an adopted model's module: the released model initialises
    for owner in sorted(owners):
        sub = module.get_submodule(owner)
        if ".lora_" in f".{owner}.":
            continue
        if has_init_weights(model):
            init_weights(model, sub)
        else:
            raise ValueError(f"no stored value and no initialisation for {owner}")
