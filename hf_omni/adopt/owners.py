"""Which module owns each tensor of an adopted model, decided from the `modules=` paths before any module is built.

A path names a submodule (its subtree, less the paths carved out of it) or one parameter or buffer (BLIP-2's
`query_tokens`, held by the root model itself); a tensor's owner is the module of the longest path that holds it,
by name. A tied tensor goes by several names, and each name needs an owner: a submodule outside every module whose
tensors are all tied to one module's (Gemma3's `lm_head`, tied to the embeddings) is taken into that module:
left outside, a sharded module's wrap would give the module its sharded copy and leave the outside holder the
unsharded original (its tied head then no longer the trained embeddings).
"""

from __future__ import annotations

import logging

from torch import nn

logger = logging.getLogger(__name__)


def normalise(modules: dict) -> dict[str, list[str]]:
    """{name: [path, ...]} from {name: path | [paths]}, each path checked as a plain dotted attribute path."""
    if not isinstance(modules, dict) or not modules:
        raise ValueError("from_model: modules= must map module names to attribute paths, e.g. {'vision': "
                         "'model.vision_tower', 'llm': ['model.language_model', 'lm_head']}")
    out = {}
    for name, paths in modules.items():
        paths = [paths] if isinstance(paths, str) else list(paths) if isinstance(paths, (list, tuple)) else None
        if not isinstance(name, str) or not name.isidentifier() or not paths or not all(
                isinstance(p, str) and (p == "" or all(s.isidentifier() or s.isdigit() for s in p.split(".")))
                for p in paths):
            raise ValueError(f"from_model: module {name!r}: {modules[name]!r} is not an attribute path or a list of "
                             "them (e.g. 'model.vision_tower')")
        if name == "released":
            raise ValueError("from_model: 'released' is not a module name: a checkpoint's folder of that name holds "
                             "the model in its released format")
        out[name] = paths
    return out


def kind_of(model: nn.Module, path: str) -> str | None:
    """What `path` names in `model`: 'submodule', 'parameter', 'buffer', or None."""
    parent, _, attr = path.rpartition(".")
    try:
        holder = model.get_submodule(parent) if parent else model
    except AttributeError:
        return None
    for kind, table in (("submodule", holder._modules), ("parameter", holder._parameters), ("buffer", holder._buffers)):
        if table.get(attr) is not None:
            return kind
    return None


def contents(model: nn.Module, path: str) -> str:
    """What a module at `path` holds by name, for a refusal to suggest."""
    module = model.get_submodule(path) if path else model
    found = [f"{kind} {names}" for kind, names in (
        ("submodules", [n for n, m in module._modules.items() if m is not None]),
        ("parameters", [n for n, p in module._parameters.items() if p is not None]),
        ("buffers", [n for n, b in module._buffers.items() if b is not None])) if names]
    return f"{path!r} holds " + ", ".join(found) if path else f"the model holds {', '.join(found)}"


def check_paths(model: nn.Module, mapping: dict[str, list[str]]) -> dict[str, str]:
    """Every path names a submodule, a parameter or a buffer, given once and not inside another path of its own
    module, and no tensor is carved out of another module's submodule; returns what each path names."""
    cls = type(model).__name__
    kinds = {}
    for name, paths in mapping.items():
        for path in paths:
            if path == "":
                raise ValueError(f"from_model: module {name!r}: '' names the whole {cls}; name what the module holds "
                                 f"instead ({contents(model, '')}): a path may name a submodule, parameter or buffer")
            kinds[path] = kind_of(model, path)
            if kinds[path] is None:
                raise ValueError(f"from_model: module {name!r}: {cls} has no submodule, parameter or buffer {path!r}"
                                 f"{_nearest(model, path)}")
    every = [(name, path) for name, paths in mapping.items() for path in paths]
    for i, (name, path) in enumerate(every):
        for other_name, other in every[i + 1:]:
            if path == other:
                raise ValueError(f"from_model: path {path!r} is given to modules {name!r} and {other_name!r}")
            inner, outer, outer_name = (path, other, other_name) if path.startswith(other + ".") else (
                other, path, name) if other.startswith(path + ".") else (None, None, None)
            if inner is None:
                continue
            inner_name = other_name if outer_name == name else name
            if name == other_name:
                raise ValueError(f"from_model: module {name!r}: {inner!r} lies inside its own {outer!r}")
            if kinds[inner] != "submodule":
                parent = inner.rpartition(".")[0]
                raise ValueError(
                    f"from_model: module {inner_name!r}: {inner!r} is a {kinds[inner]} of {parent!r}, inside module "
                    f"{outer_name!r}'s path {outer!r}; a single tensor is not carved out of another module's "
                    f"submodule: leave it to {outer_name!r}, or give {inner_name!r} its submodule {parent!r}")
    return kinds


def _nearest(model: nn.Module, path: str) -> str:
    """Where `path` stops naming anything, and what is there (or what else the attribute is)."""
    parts = path.split(".")
    for i in range(len(parts) - 1, -1, -1):
        prefix = ".".join(parts[:i])
        if kind_of(model, prefix) == "submodule" or not prefix:
            holder = model.get_submodule(prefix) if prefix else model
            value = getattr(holder, parts[i], None)
            what = f" ({parts[i]!r} is a {type(value).__name__} attribute)" if value is not None and i == len(
                parts) - 1 else ""
            return f"{what}; {contents(model, prefix)}"
    return ""


def owner_of(tensor_name: str, owners: dict[str, str]) -> str | None:
    """The module of the longest path (`owners`: path -> module) that is `tensor_name` or holds it."""
    parts = tensor_name.split(".")
    for i in range(len(parts), 0, -1):
        found = owners.get(".".join(parts[:i]))
        if found is not None:
            return found
    return None


def outside(model: nn.Module, mapping: dict[str, list[str]]) -> dict[str, list[tuple[str, object]]]:
    """The tensors no path holds, by name, grouped by the largest submodule (or the tensor itself) that holds them
    and lies outside every module's paths: {unit path: [(tensor name, tensor), ...]}."""
    owners = {path: name for name, paths in mapping.items() for path in paths}
    units: dict[str, list] = {}
    for tensor_name, tensor in list(model.named_parameters(remove_duplicate=False)) + list(
            model.named_buffers(remove_duplicate=False)):
        if owner_of(tensor_name, owners) is not None:
            continue
        parts = tensor_name.split(".")
        unit = next(p for p in (".".join(parts[:i]) for i in range(1, len(parts) + 1))
                    if not any(q.startswith(p + ".") for q in owners))
        units.setdefault(unit, []).append((tensor_name, tensor))
    return units


def claim_tied(model: nn.Module, mapping: dict[str, list[str]]) -> dict[str, list[str]]:
    """`mapping` with each submodule outside every module whose tensors are all tied to one module's tensors added
    to that module's paths (logged); one tied to several modules, or holding untied tensors too, refused. Units with
    untied tensors only are left for `check_owned` to list."""
    owners = {path: name for name, paths in mapping.items() for path in paths}
    by_id: dict[int, tuple[str, str]] = {}  # tensor -> (module, a name it goes by there)
    for tensor_name, tensor in list(model.named_parameters(remove_duplicate=False)) + list(
            model.named_buffers(remove_duplicate=False)):
        module = owner_of(tensor_name, owners)
        if module is not None:
            by_id.setdefault(id(tensor), (module, tensor_name))
    out = {name: list(paths) for name, paths in mapping.items()}
    for unit, tensors in outside(model, mapping).items():
        tied = {n: by_id[id(t)] for n, t in tensors if id(t) in by_id}
        if not tied:
            continue
        modules = sorted({m for m, _ in tied.values()})
        untied = [n for n, _ in tensors if n not in tied]
        pairs = ", ".join(f"{n} = {other} (module {m!r})" for n, (m, other) in tied.items())
        shown = ", ".join(f"{n} = {other}" for n, (_, other) in tied.items())
        if untied or len(modules) > 1:
            why = f"also holds untied tensors {untied}" if untied else f"is tied to modules {modules}"
            raise ValueError(f"from_model: {unit!r}, outside every module, holds tied tensors ({pairs}) and {why}: "
                             f"give {unit!r} to a module in modules= (tied tensors belong to one module)")
        out[modules[0]].append(unit)
        logger.warning("hf_omni: from_model: %r is in no module and all its tensors are tied to tensors of module "
                       "%r (%s): taken into %r, and recorded in its paths", unit, modules[0], shown, modules[0])
    return out


def check_owned(model: nn.Module, parts: dict) -> None:
    """Every tensor of `model` in exactly one module: unassigned ones are listed by name, and a tensor two modules
    hold (tied across them) names both."""
    owner: dict[int, tuple[str, str]] = {}
    for name, part in parts.items():
        for tensor_name, tensor in list(part.named_parameters(remove_duplicate=False)) + list(
                part.named_buffers(remove_duplicate=False)):
            first = owner.setdefault(id(tensor), (name, tensor_name))
            if first[0] != name:
                raise ValueError(f"from_model: {first[1]} (module {first[0]!r}) and {tensor_name} (module {name!r}) "
                                 "are one tensor (tied weights): put both paths in one module")
    mapping = {name: [p for p in part.omni_paths] for name, part in parts.items()}
    units = outside(model, mapping)
    unassigned = [n for tensors in units.values() for n, _ in tensors]
    if unassigned:
        kinds = {unit: kind_of(model, unit) for unit in units}
        raise ValueError(f"from_model: {len(unassigned)} tensors of {type(model).__name__} belong to no module: "
                         f"{unassigned[:8]}{' ...' if len(unassigned) > 8 else ''}. Give each to a module in "
                         f"modules= by its path ({', '.join(f'{u!r}: a {k}' for u, k in kinds.items())}); every "
                         "parameter and buffer is trained, saved and sharded by exactly one")
