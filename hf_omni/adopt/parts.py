"""The modules of an adopted model: each is one or several submodules of the released model, by attribute path,
and may be carved out of another's subtree (Qwen2.5-VL's projector `model.visual.merger` inside `model.visual`).

A module is held by a `Part`: a container whose attribute tree mirrors the released model's down to the module's
paths, so that its tensor names are the released model's own (`model.language_model.layers.0...`, `lm_head.weight`)
and its state dict, optimizer state and checkpoints are keyed as the original files are. The submodules are the
released model's own objects: moving, freezing, LoRA or sharding them acts on the model whose `forward` runs. A
path with a carved-out descendant is held through a `Shell` of it: the same tensors and children, less the carved
ones (they belong to the other module). A path may also name one parameter or buffer (BLIP-2's `query_tokens`, an
attribute of the root model): the Part holds that tensor under its released name (`Loose`), in a table that writes
through to its released holder's.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from ..compat import copy_tied_weights_keys
from ..modules.units import Root, RootedModule
from .owners import check_owned, check_paths, normalise


class Part(RootedModule):
    """One module of an adopted model. It is never called: the released model's `forward` runs its submodules."""

    base_model_prefix = ""  # PEFT asks transformers for the conversion mapping of the submodules it holds (a MoE
    # language model's fused experts: Qwen3-Omni's thinker), which reads it off the model it is given: this part

    def __init__(self, name: str, config=None):
        super().__init__()
        self.omni_name = name
        self.omni_paths: list[str] = []  # all of them, in the mapping's order
        self.config = config  # the released model's (its `use_cache`, quantisation, ...)

    def forward(self, *args, **kwargs):
        raise RuntimeError(f"module {self.omni_name!r} of an adopted model is not called alone: the released "
                           "model's own forward (or generate) runs it")

    def get_input_embeddings(self):
        """The token embeddings inside it, if it holds a language model's (NEFTune, tied-weight units)."""
        for root in self.omni_roots:
            get = getattr(root.module, "get_input_embeddings", None)
            if callable(get):
                try:
                    found = get()
                except (NotImplementedError, AttributeError):
                    continue
                if found is not None:
                    return found
        return None


class Shell(nn.Module):
    """A released submodule less its carved-out children: its own tensors (the same tables) and the rest of its
    children, for enumeration only (the real submodule runs)."""

    def __init__(self, real: nn.Module, carved: list[str]):
        super().__init__()
        self.__dict__["omni_real"] = real  # not a child: its tensors are listed through this shell
        self._parameters, self._buffers = real._parameters, real._buffers
        self._non_persistent_buffers_set = real._non_persistent_buffers_set
        for child_name, child in real._modules.items():
            below = [c.split(".", 1)[1] for c in carved if c.startswith(child_name + ".")]
            if child_name in carved or child is None:
                continue
            self._modules[child_name] = Shell(child, below) if below else child

    def forward(self, *args, **kwargs):
        raise RuntimeError("a Shell only lists a submodule's tensors; the submodule itself runs")


def build_parts(model: nn.Module, modules: dict) -> dict[str, Part]:
    """One `Part` per module of `model` (a released model), every parameter and buffer owned by exactly one."""
    mapping = normalise(modules)
    kinds = check_paths(model, mapping)
    every = [path for paths in mapping.values() for path in paths]
    parts = {}
    for name, paths in mapping.items():
        part = parts[name] = Part(name, getattr(model, "config", None))
        copy_tied_weights_keys(model, part)  # the names are the released model's
        part.__dict__["omni_released"] = model  # not a child: whose key conversion its files follow
        part.omni_paths = list(paths)
        for path in paths:
            if kinds[path] != "submodule":
                part.omni_tensors.append(_place_tensor(part, model, path, kinds[path]))
                continue
            carved = sorted(p[len(path) + 1:] for p in every if p.startswith(path + "."))
            carved = [c for c in carved if not any(c.startswith(o + ".") for o in carved)]  # the nearest ones
            real = model.get_submodule(path)
            if isinstance(real, (nn.ModuleList, nn.ModuleDict)) and not carved:  # a container runs no forward of its
                part.omni_roots += [Root(f"{path}.{k}", child, [])  # own (Qwen3-Omni's per-codebook heads): each
                                    for k, child in real.named_children()]  # child is a root, wrapped on its own
            else:
                part.omni_roots.append(Root(path, real, carved))
            _place(part, path, Shell(real, carved) if carved else real)
    check_owned(model, parts)
    return parts


def _holder(part: Part, path: str) -> nn.Module:
    """The Part's container at `path` (the Part itself for ''), made as a plain module where missing."""
    holder = part
    for attr in path.split(".") if path else ():
        if attr not in holder._modules:
            holder._modules[attr] = nn.Module()
        holder = holder._modules[attr]
    return holder


def _place(part: Part, path: str, module: nn.Module) -> None:
    parent, _, last = path.rpartition(".")
    _holder(part, parent)._modules[last] = module


def _place_tensor(part: Part, model: nn.Module, path: str, kind: str) -> "Loose":
    """A parameter or buffer named by its own path, held in the Part under its released name through a table that
    writes through to its released holder's (a device move or a meta tensor's allocation replaces it in both)."""
    parent, _, attr = path.rpartition(".")
    real = model.get_submodule(parent) if parent else model
    holder = _holder(part, parent)
    for table in ("_parameters", "_buffers"):
        if not isinstance(getattr(holder, table), Through):
            holder.__dict__[table] = Through(getattr(real, table), getattr(holder, table))
    if kind == "parameter":
        holder._parameters[attr] = real._parameters[attr]
    else:
        holder._buffers[attr] = real._buffers[attr]
        if attr in real._non_persistent_buffers_set:
            holder._non_persistent_buffers_set.add(attr)
    return Loose(path, real, attr)


class Through(dict):
    """Some of a released submodule's parameters (or buffers), by name: what is set here is set there too."""

    def __init__(self, real: dict, own: dict):
        super().__init__(own)
        self.real = real

    def __setitem__(self, key, value):
        super().__setitem__(key, value)
        self.real[key] = value


@dataclass
class Loose:
    """A path of a module that names one parameter or buffer (BLIP-2's `query_tokens`): no strategy wraps it alone;
    under a collective one it is kept whole on every rank (`parallel.loose`)."""

    path: str
    holder: nn.Module  # the released submodule whose attribute it is
    attr: str

    @property
    def tensor(self):
        return self.holder._parameters.get(self.attr, self.holder._buffers.get(self.attr))


def sync_into(model: nn.Module, parts: dict[str, Part]) -> None:
    """After LoRA injection: a submodule PEFT replaced in a Part (LoRA on `lm_head` itself, or on a child of a
    shelled path) replaces it in the released model too, so that its forward runs the adapted layer."""
    for part in parts.values():
        for root in part.omni_roots:
            live = part.get_submodule(root.path)
            if isinstance(live, Shell):
                _sync_shell(live)
            elif live is not root.module:
                parent, _, attr = root.path.rpartition(".")
                setattr(model.get_submodule(parent) if parent else model, attr, live)
                root.module = live


def _sync_shell(shell: Shell) -> None:
    real = shell.omni_real
    for child_name, child in shell._modules.items():
        if isinstance(child, Shell):
            _sync_shell(child)
        elif real._modules.get(child_name) is not child:
            real._modules[child_name] = child
