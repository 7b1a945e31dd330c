"""The modules of an adopted model: each is one or several submodules of the released model, by attribute path,
and may be carved out of another's subtree (Qwen2.5-VL's projector `model.visual.merger` inside `model.visual`).

A module is held by a `Part`: a container whose attribute tree mirrors the released model's down to the module's
paths, so that its tensor names are the released model's own (`model.language_model.layers.0...`, `lm_head.weight`)
and its state dict, optimizer state and checkpoints are keyed as the original files are. The submodules are the
released model's own objects: moving, freezing, LoRA or sharding them acts on the model whose `forward` runs. A
path with a carved-out descendant is held through a `Shell` of it: the same tensors and children, less the carved
ones (they belong to the other module).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn


class Part(nn.Module):
    """One module of an adopted model. It is never called: the released model's `forward` runs its submodules."""

    def __init__(self, name: str, config=None):
        super().__init__()
        self.omni_name = name
        self.omni_roots: list[Root] = []
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


@dataclass
class Root:
    """A path of a module: the released submodule there (what a strategy wraps) and the parameters under it that
    belong to carved-out modules (a wrap leaves them to theirs)."""

    path: str
    module: nn.Module
    carved: list[str] = field(default_factory=list)  # paths, relative to this one

    @property
    def depth(self) -> int:
        return self.path.count(".") + 1

    def carved_params(self) -> set:
        return {p for c in self.carved for p in self.module.get_submodule(c).parameters()}


def normalise(modules: dict) -> dict[str, list[str]]:
    """{name: [path, ...]} from {name: path | [paths]}, each path checked as a plain dotted attribute path."""
    if not isinstance(modules, dict) or not modules:
        raise ValueError("from_model: modules= must map module names to attribute paths, e.g. {'vision': "
                         "'model.vision_tower', 'llm': ['model.language_model', 'lm_head']}")
    out = {}
    for name, paths in modules.items():
        paths = [paths] if isinstance(paths, str) else list(paths) if isinstance(paths, (list, tuple)) else None
        if not isinstance(name, str) or not name.isidentifier() or not paths or not all(
                isinstance(p, str) and p and all(s.isidentifier() or s.isdigit() for s in p.split(".")) for p in paths):
            raise ValueError(f"from_model: module {name!r}: {modules[name]!r} is not an attribute path or a list of "
                             "them (e.g. 'model.vision_tower')")
        if name == "released":
            raise ValueError("from_model: 'released' is not a module name: a checkpoint's folder of that name holds "
                             "the model in its released format")
        out[name] = paths
    return out


def build_parts(model: nn.Module, modules: dict) -> dict[str, Part]:
    """One `Part` per module of `model` (a released model), every parameter and buffer owned by exactly one."""
    mapping = normalise(modules)
    every = [(name, path) for name, paths in mapping.items() for path in paths]
    for name, path in every:
        try:
            model.get_submodule(path)
        except AttributeError:
            raise ValueError(f"from_model: module {name!r}: {type(model).__name__} has no submodule {path!r}") from None
    for i, (name, path) in enumerate(every):
        for other_name, other in every[i + 1:]:
            if path == other:
                raise ValueError(f"from_model: path {path!r} is given to modules {name!r} and {other_name!r}")
            inner, outer = (path, other) if path.startswith(other + ".") else (other, path) \
                if other.startswith(path + ".") else (None, None)
            if inner is not None and name == other_name:
                raise ValueError(f"from_model: module {name!r}: {inner!r} lies inside its own {outer!r}")
    parts = {}
    for name, paths in mapping.items():
        part = parts[name] = Part(name, getattr(model, "config", None))
        part._tied_weights_keys = getattr(model, "_tied_weights_keys", None)  # the names are the released model's
        part.__dict__["omni_released"] = model  # not a child: whose key conversion its files follow
        for path in paths:
            carved = sorted(p[len(path) + 1:] for _, p in every if p.startswith(path + "."))
            carved = [c for c in carved if not any(c.startswith(o + ".") for o in carved)]  # the nearest ones
            real = model.get_submodule(path)
            part.omni_roots.append(Root(path, real, carved))
            _place(part, path, Shell(real, carved) if carved else real)
    check_owned(model, parts)
    return parts


def _place(part: Part, path: str, module: nn.Module) -> None:
    holder = part
    *parents, last = path.split(".")
    for attr in parents:
        if attr not in holder._modules:
            holder._modules[attr] = nn.Module()
        holder = holder._modules[attr]
    holder._modules[last] = module


def tensors_of(module: nn.Module) -> dict[int, str]:
    return {id(t): n for n, t in list(module.named_parameters(remove_duplicate=False)) + list(
        module.named_buffers(remove_duplicate=False))}


def check_owned(model: nn.Module, parts: dict[str, Part]) -> None:
    """Every tensor of `model` in exactly one module: unassigned ones are listed by name, and a tensor two modules
    hold (tied across them) names both."""
    owner: dict[int, tuple[str, str]] = {}
    for name, part in parts.items():
        for tensor_id, tensor_name in tensors_of(part).items():
            first = owner.setdefault(tensor_id, (name, tensor_name))
            if first[0] != name:
                raise ValueError(f"from_model: {first[1]} (module {first[0]!r}) and {tensor_name} (module {name!r}) "
                                 "are one tensor (tied weights): put both paths in one module")
    unassigned = [n for t, n in tensors_of(model).items() if t not in owner]
    if unassigned:
        raise ValueError(f"from_model: {len(unassigned)} tensors of {type(model).__name__} belong to no module: "
                         f"{unassigned[:8]}{' ...' if len(unassigned) > 8 else ''}. Give their submodule to a module "
                         "in modules= (every parameter and buffer is trained, saved and sharded by exactly one)")


def run_roots(module: nn.Module) -> list[nn.Module]:
    """What runs of a module: a Part's released submodules, or the module itself."""
    return [r.module for r in module.omni_roots] if isinstance(module, Part) else [module]


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
