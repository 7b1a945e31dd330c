"""Reading a module's tensors back in place from its HF folder: every parameter and persistent buffer, a sharded
one as this rank's rows only.

Where each tensor lives in the folder is traced, not guessed (`saved_keys.file_layout`): meta placeholders of the
module's tensors go through exactly what a save applies (`folder_plan`) (LoRA keys split off, transformers' save-time
key conversion, PEFT's adapter naming), and a tensor whose placeholder comes out under some key, as the same object,
is stored there as is. What the files do not hold as is (MoE experts that transformers splits on save, ...) a
checkpoint keeps in its `state/` (`checkpoint.module_state`); a plain HF folder (`empty_init`, a frozen module's source)
serves fused MoE experts row by row (`expert_rows`: each rank the files of its own experts) and anything else
through transformers' own loading (`read_through_transformers`).

`empty_init` (`fill_module`): a module that will be sharded is sharded first (on meta), then every rank allocates
its own shards and reads just its box of each tensor (`get_slice`; rows, or columns of a `Shard(1)` tensor): no rank
holds a full copy, no communication. A module every rank holds whole (ddp, none) is read in stripes: each rank its
share of the tensors, dealt by bytes, then one broadcast per tensor (`shards.replicas.stripes`).
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from ..compat import has_init_weights, init_lora_layer, init_weights, own_tensors
from ..core.dist import agreed, checkpoint_group
from ..lora.adapters import ADAPTER_WEIGHTS, base_key, has_adapter, lora_config_of
from ..shards.box import box_of, copy_into, local_box
from ..shards.replicas import read_once, readers
from .empty_init import materialize
from .expert_rows import read_fused_rows
from .folder_plan import ADAPTER
from .format import original_class
from .lora_base import weights_folder
from .safetensors_index import SafetensorsIndex
from .saved_keys import file_layout, module_tensors
from .whole import check_whole_copy

logger = logging.getLogger(__name__)


def _castable(saved: torch.dtype | None, ours: torch.dtype) -> bool:
    return saved == ours or (saved is not None and saved.is_floating_point and ours.is_floating_point)


@torch.no_grad()
def read_into(module: nn.Module, folder: str, strict: bool = False, module_name: str = "", dry_run: bool = False,
              skip: frozenset[str] = frozenset(), replicated: bool = False) -> list[str]:
    """Copy the tensors `folder`'s HF files hold (LoRA adapter beside them) into `module` in place, cast to each
    tensor's own dtype; a sharded tensor reads only this rank's box of it (`shards.box.local_box`: rows, columns).
    Shapes (and integer dtypes) must match: the error names module and tensor. Returns the tensors the files lack
    (`strict`: an error); `skip` are read elsewhere. Under HSDP the first replica reads and sends; `replicated`
    (every rank calls this for a module every rank holds whole): each rank reads its stripe of the tensors and
    broadcasts it (`shards.replicas.read_once`)."""
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
        read_once([tensor for tensor, *_ in plan], lambda i: copy_into(plan[i][0], plan[i][1].read(
            plan[i][2], local_box(plan[i][0]))), f"module {module_name!r}: reading {folder}", replicated)
    return missing


def check_shapes(plan: list, module_name: str, folder: str, replicated: bool, agree: bool = True) -> None:
    """Each (tensor, file index, key, name) of `plan` against its file's header, by the ranks that will read it
    (others open no file for it); when some ranks check less, they all agree on the outcome before reading
    (`agree`; a dry run is inside the caller's own agreement, which nothing may precede on one rank alone)."""

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
    for tensors the files do not hold as is; refused above `whole.WHOLE_COPY_LIMIT`. Returns the names
    transformers' model does not have either."""
    check_through_transformers(module, names, module_name)
    dtype = next((t.dtype for t in module.parameters() if t.is_floating_point()), None)
    loaded = original_class(module).from_pretrained(weights_folder(folder), dtype=dtype).state_dict()
    tensors = module_tensors(module)
    left = []
    for name in names:
        value, tensor = loaded.get(base_key(name)), tensors[name]
        if value is None or tuple(value.shape) != tuple(tensor.shape):
            left.append(name)
            continue
        copy_into(tensor, box_of(value, tensor))
    logger.info("hf_omni: module %r: %d tensors read through transformers' loading from %s", module_name,
                len(names) - len(left), folder)
    return left


def check_through_transformers(module: nn.Module, names: list[str], module_name: str) -> None:
    """`read_through_transformers` of `names` within the limit for whole copies (else the error, with what to do)."""
    check_whole_copy(module, module_name, f"reading {len(names)} tensors ({', '.join(names[:3])}) through "
                     "transformers' loading, which the files do not hold as they are,",
                     "resume from a checkpoint hf_omni wrote (its `state/` keeps them as trained), build the module "
                     "without `empty_init` (transformers then loads it whole on each rank, as you chose), or raise "
                     "the limit where every host has room for one copy per rank")


@torch.no_grad()
def fill_module(module: nn.Module, folder: str, device: torch.device, module_name: str = "",
                replicated: bool = False) -> list[str]:
    """Allocate `module`'s meta tensors on `device` (only the local shards of sharded ones) and read them from the
    HF folder `folder`; returns the names it lacks (initialised by the module instead, with a warning, as
    `from_pretrained` does). `replicated`: every rank calls this for a module each holds whole: each reads its
    stripe of the tensors and broadcasts it (`shards.replicas.read_once`)."""
    materialize(module, device)  # tied parameters stay one parameter
    move_buffers(module, device)  # computed buffers (rotary tables) move; persistent ones are read below
    missing = read_into(module, folder, module_name=module_name, replicated=replicated)
    layout = file_layout(module)
    unmapped = [n for n in missing if n not in layout]
    if unmapped:
        unmapped, absent = read_fused_rows(module, folder, unmapped, module_name, replicated)
        missing = [n for n in missing if n in layout] + absent + (
            read_through_transformers(module, folder, unmapped, module_name) if unmapped else [])
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
