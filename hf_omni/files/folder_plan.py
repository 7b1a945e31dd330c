"""A module's HF files planned from metadata alone: every key transformers' `save_pretrained` (and PEFT's adapter
file) would write, with its dtype, shape and byte offset, so that every rank can write its own part of each file
in place and no rank holds the module (`folder_write`).

The keys come from what a save applies, run on meta placeholders of the module's tensors (in the dtype each is
exported in): PEFT's additions split off, the keys its format leaves out (transformers' `_keys_to_ignore_on_save`),
tied aliases dropped by transformers' rule (a key matching the model's tied-weight patterns goes, unless every
alias matches), its format's save-time key conversion (`ModuleFormat.convert_keys`; the file names are the
format's too). A key whose placeholder comes out as the same object is one of the module's tensors written as is;
the others are derived (MoE experts split on save): each group of source tensors converted together is written
by one rank, from the source tensors gathered there. The files are split as transformers splits them
(`split_torch_state_dict_into_shards`, 50 GB); each file is a safetensors header followed by the tensors in
order.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass, field

import torch
from torch import nn

from ..compat import tied_weight_patterns
from ..core.dtypes import SAFETENSORS
from ..lora.adapters import ADAPTER_WEIGHTS, adapter_state_dict, base_state_dict, lora_config_of
from .format import format_of

MAX_SHARD_SIZE = "50GB"  # transformers' save_pretrained default


@dataclass
class Entry:
    """One tensor of a file: where its bytes go, and where they come from (`source`: a module tensor written as
    is; else `group`: the conversion group that derives it)."""

    key: str
    file: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int
    source: str | None = None
    group: int | None = None

    @property
    def nbytes(self) -> int:
        return _nbytes(self.shape, self.dtype)


@dataclass
class FolderPlan:
    files: dict[str, bytes] = field(default_factory=dict)  # file name -> its header (8-byte length + JSON)
    entries: list[Entry] = field(default_factory=list)
    groups: list[tuple[str, list[str]]] = field(default_factory=list)  # (WEIGHTS | ADAPTER, source tensor names)
    aliases: dict[str, list[str]] = field(default_factory=dict)  # a derived group's source -> its state-dict keys
    index: dict | None = None  # the format's index (model.safetensors.index.json), when the weights span files

    def size(self, name: str) -> int:
        return len(self.files[name]) + sum(e.nbytes for e in self.entries if e.file == name)

    def adapter_only(self) -> "FolderPlan":
        """The adapter file alone: a checkpoint's folder of a LoRA module whose base is written once (`lora_base`)."""
        return FolderPlan({n: h for n, h in self.files.items() if n == ADAPTER_WEIGHTS},
                          [e for e in self.entries if e.file == ADAPTER_WEIGHTS], self.groups, self.aliases)


WEIGHTS, ADAPTER = "weights", "adapter"


def _nbytes(shape, dtype) -> int:
    numel = 1
    for n in shape:
        numel *= n
    return numel * dtype.itemsize


def placeholders(module: nn.Module, dtypes: dict[str, torch.dtype]) -> tuple[dict, dict[int, str]]:
    """Meta stand-ins of every tensor the module's state dict holds, by state-dict key (tied aliases share one),
    in the dtype each is exported in (`dtypes` by tensor name; else its own); and stand-in id -> tensor name."""
    persistent = set(module.state_dict(keep_vars=True))
    every = list(module.named_parameters(remove_duplicate=False)) + [
        (n, b) for n, b in module.named_buffers(remove_duplicate=False) if n in persistent]
    canonical = {id(t): n for n, t in list(module.named_parameters()) + list(module.named_buffers())}
    made, out = {}, {}
    for name, tensor in every:
        if id(tensor) not in made:
            owner = canonical[id(tensor)]
            made[id(tensor)] = (torch.empty(tuple(tensor.shape), dtype=dtypes.get(owner, tensor.dtype), device="meta"),
                                owner)
        out[name] = made[id(tensor)][0]
    return out, {id(ph): owner for ph, owner in made.values()}


def drop_tied_aliases(model: nn.Module, state: dict) -> dict:
    """`state` without the aliases transformers' `save_pretrained` drops (safetensors holds no aliases)."""
    import re

    by_tensor: dict[int, list[str]] = {}
    for key, value in state.items():
        by_tensor.setdefault(id(value), []).append(key)
    patterns = tied_weight_patterns(model)
    drop = set()
    for names in (n for n in by_tensor.values() if len(n) > 1):
        matching = [n for n in sorted(names) if any(re.search(p, n) for p in patterns)]
        drop.update(matching if len(matching) < len(names) else matching[:-1])
        if len(names) - len(set(names) & drop) > 1:
            raise ValueError(f"tensors {sorted(names)} are one tensor, but the model does not declare them tied "
                             "(`_tied_weights_keys`): transformers refuses to save such a model")
    return {k: v for k, v in state.items() if k not in drop}


def weights_keys(module: nn.Module, state: dict) -> dict[str, torch.Tensor]:
    """What `save_pretrained` would write for `state` (tensors or meta stand-ins), by key, in its order: the keys
    its format leaves out dropped, tied aliases dropped, the format's save-time key conversion applied."""
    fmt = format_of(module)
    view = fmt.save_view(module)
    base = base_state_dict(state)
    for key in fmt.keys_to_ignore(view):
        base.pop(key, None)
    return fmt.convert_keys(view, drop_tied_aliases(view, base))


def _groups(convert, state: dict, owner: dict[int, str], derived: dict[str, torch.Tensor]) -> list[list[str]]:
    """The source tensors of the derived keys, one group per source tensor when each converts alone to its own
    keys, else a single group."""
    sources = sorted({owner[id(v)] for v in state.values() if id(v) in owner} - set(
        owner[id(v)] for v in convert(state).values() if id(v) in owner))
    groups, seen = [], set()
    for source in sources:
        alone = convert({k: v for k, v in state.items() if owner.get(id(v)) == source})
        keys = {k for k, v in alone.items() if id(v) not in owner}
        if not keys or keys & seen or not keys <= set(derived) or any(
                tuple(alone[k].shape) != tuple(derived[k].shape) for k in keys):
            return [sources]
        groups.append([source])
        seen |= keys
    return groups if seen == set(derived) else [sources]


def header(entries: list[Entry]) -> bytes:
    """The safetensors header of a file holding `entries` in order (offsets relative to the data)."""
    meta, start = {"__metadata__": {"format": "pt"}}, 0
    for e in entries:
        meta[e.key] = {"dtype": SAFETENSORS[e.dtype], "shape": list(e.shape), "data_offsets": [start, start + e.nbytes]}
        start += e.nbytes
    text = json.dumps(meta, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


def plan_folder(module: nn.Module, dtypes: dict[str, torch.dtype] | None = None,
                max_shard_size: str | int = MAX_SHARD_SIZE, merged: bool = False) -> FolderPlan:
    """The plan of `module`'s HF files (weights, and the adapter file of a LoRA module; `merged`: the weights of
    the LoRA merged into them alone); every rank computes the same one."""
    from huggingface_hub import split_torch_state_dict_into_shards

    state, owner = placeholders(module, dtypes or {})
    plan = FolderPlan()
    weights = weights_keys(module, state)
    pattern = format_of(module).weights_pattern  # transformers': model{suffix}.safetensors
    split = split_torch_state_dict_into_shards(weights, filename_pattern=pattern, max_shard_size=max_shard_size)
    layout = [(WEIGHTS, name, {k: weights[k] for k in keys}) for name, keys in split.filename_to_tensors.items()]
    if split.is_sharded:
        total = module.num_parameters() if hasattr(module, "num_parameters") else None  # as transformers records
        if total is not None and merged:
            total -= sum(p.numel() for n, p in module.named_parameters() if ".lora_" in n)
        plan.index = {"metadata": {**({"total_parameters": total} if total is not None else {}),
                                   "total_size": sum(_nbytes(v.shape, v.dtype) for v in weights.values())},
                      "weight_map": dict(sorted(split.tensor_to_filename.items()))}
    if lora_config_of(module) is not None and not merged:
        layout.append((ADAPTER, ADAPTER_WEIGHTS, adapter_state_dict(module, state)))
    converters = {WEIGHTS: lambda s: weights_keys(module, s), ADAPTER: lambda s: adapter_state_dict(module, s)}
    for kind, name, tensors in layout:
        derived = {k: v for k, v in tensors.items() if id(v) not in owner}
        first = len(plan.groups)
        if derived:
            plan.groups += [(kind, g) for g in _groups(converters[kind], state, owner, derived)]
        group_of = {}
        for index in range(first, len(plan.groups)):
            alone = converters[kind]({k: v for k, v in state.items() if owner.get(id(v)) in plan.groups[index][1]})
            group_of.update((k, index) for k, v in alone.items() if id(v) not in owner)
        entries, offset = [], 0
        for key, value in tensors.items():
            entry = Entry(key, name, value.dtype, tuple(value.shape), offset, source=owner.get(id(value)),
                          group=None if id(value) in owner else group_of[key])
            entries.append(entry)
            offset += entry.nbytes
        head = header(entries)
        for entry in entries:
            entry.offset += len(head)
        plan.files[name] = head
        plan.entries += entries
    derived_sources = {source for _, sources in plan.groups for source in sources}
    for key, value in state.items():
        if owner.get(id(value)) in derived_sources:
            plan.aliases.setdefault(owner[id(value)], []).append(key)
    return plan
