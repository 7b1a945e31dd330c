"""No import circle between hf_omni's own files or folders, imports inside functions counted (design.md section 3);
every import runs down the layers; every package's docstring names its files. The limits of 250 lines a file and 60
lines a function are `test_compat.test_package_layout_rules`.

Every `hf_omni/**/*.py` is parsed with `ast`; every import of an hf_omni module, at the top or anywhere below it, is an
edge (relative imports resolved; `from . import x` where x is a submodule is an edge to that submodule). A strongly
connected component of more than one file is a circle, and fails naming its files unless it is allowed below.
A package's face (`__init__.py`) is a file like any other: importing a name it defines is an edge to it, and its
own imports are its edges. Imports under `if TYPE_CHECKING:` are not counted (annotations only: the slot is typed
with classes of the layers above it).
"""

from __future__ import annotations

import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = os.path.join(ROOT, "hf_omni")

# Circles kept on purpose, each a set of files (paths from the repository root) and why.
ALLOWED: list[set[str]] = []


def _modules() -> dict[str, str]:
    """Dotted module name -> path from the repository root, for every file of the package."""
    out = {}
    for folder, _, names in os.walk(PACKAGE):
        for name in names:
            if name.endswith(".py"):
                rel = os.path.relpath(os.path.join(folder, name), ROOT).replace(os.sep, "/")
                dotted = rel[:-3].replace("/", ".")
                out[dotted[:-len(".__init__")] if dotted.endswith(".__init__") else dotted] = rel
    return out


def _imported(node: ast.AST, module: str, is_package: bool, modules: dict[str, str]) -> set[str]:
    """The hf_omni modules one import statement of `module` names."""
    if isinstance(node, ast.Import):
        targets = [alias.name for alias in node.names]
    else:
        if node.level:
            base = module.split(".")[:len(module.split(".")) - node.level + (1 if is_package else 0)]
            parent = ".".join(base + ([node.module] if node.module else []))
        else:
            parent = node.module
        subs = [f"{parent}.{alias.name}" for alias in node.names]
        # `from pkg import sub` names the submodule; a name defined in `pkg` names pkg (its face, for a package)
        targets = [sub for sub in subs if sub in modules]
        targets += [parent] if any(sub not in modules for sub in subs) else []
    found = set()
    for target in targets:
        while target and target not in modules:  # `import hf_omni.a.b` names hf_omni.a.b; a name in it names it
            target = target.rpartition(".")[0]
        if target:
            found.add(target)
    return found


def _runtime_nodes(tree: ast.AST):
    """Every node of `tree` but those under `if TYPE_CHECKING:` (annotations only: never run, so no import order)."""
    stack = [tree]
    while stack:
        node = stack.pop()
        yield node
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and getattr(child.test, "id", getattr(child.test, "attr", None)) == \
                    "TYPE_CHECKING":
                stack.extend(child.orelse)
                continue
            stack.append(child)


def import_graph() -> dict[str, set[str]]:
    """File -> the hf_omni files it imports (paths from the repository root), imports inside functions included."""
    modules = _modules()
    graph = {}
    for module, rel in modules.items():
        with open(os.path.join(ROOT, rel)) as f:
            tree = ast.parse(f.read(), rel)
        edges = set()
        for node in _runtime_nodes(tree):
            if isinstance(node, ast.Import) or (isinstance(node, ast.ImportFrom) and (node.level or (
                    node.module or "").split(".")[0] == "hf_omni")):
                edges |= _imported(node, module, rel.endswith("__init__.py"), modules)
        graph[rel] = {modules[m] for m in edges} - {rel}
    return graph


def circles(graph: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected components of more than one file (Tarjan's algorithm, iterative)."""
    index, low, on_stack, stack, found, counter = {}, {}, set(), [], [], [0]
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter[0]
        counter[0] += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter[0]
                    counter[0] += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(component)
    return found


def test_no_import_circle_between_hf_omni_files():
    found = circles(import_graph())
    new = [c for c in found if c not in ALLOWED]
    assert not new, "import circles (imports inside functions count): " + "; ".join(
        " <-> ".join(sorted(c)) for c in new)
    assert all(c in found for c in ALLOWED), "an allowed circle is gone: take it off ALLOWED"


def folder_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """The import graph between folders (a package, or a file at the top of hf_omni): an edge wherever a file of one
    imports a file of the other."""
    def folder(path: str) -> str:
        parts = path.split("/")
        return "/".join(parts[:2]) if len(parts) > 2 else path

    out: dict[str, set[str]] = {folder(p): set() for p in graph}
    for src, dsts in graph.items():
        out[folder(src)] |= {folder(d) for d in dsts} - {folder(src)}
    return out


def test_no_import_circle_between_folders():
    """Files in no circle can still make one between their folders (a.x -> b.y -> a.z): none either."""
    found = circles(folder_graph(import_graph()))
    assert not found, "import circles between folders: " + "; ".join(" <-> ".join(sorted(c)) for c in found)


def test_every_package_docstring_names_its_files():
    """A package's face says what each of its files is for: each file's name stands in its docstring, as `name`."""
    missing = []
    for folder, _, names in os.walk(PACKAGE):
        face = os.path.join(folder, "__init__.py")
        if "__pycache__" in folder or not os.path.isfile(face):
            continue
        with open(face) as f:
            doc = ast.get_docstring(ast.parse(f.read())) or ""
        missing += [f"{os.path.relpath(folder, ROOT)}/{n}" for n in sorted(names)
                    if n.endswith(".py") and n != "__init__.py" and f"`{n[:-3]}`" not in doc and f"`{n}`" not in doc]
    assert not missing, "files a package docstring does not name: " + ", ".join(missing)


def test_the_graph_sees_imports_inside_functions_and_submodules_imported_from_a_package():
    graph = import_graph()
    assert "hf_omni/hub/push.py" in graph["hf_omni/modeling.py"]  # inside OmniModel.push_to_hub
    assert "hf_omni/files/folder_write.py" in graph["hf_omni/checkpoint/bases.py"]  # `from ..modules import x`
    assert "hf_omni/modules/__init__.py" not in graph["hf_omni/checkpoint/bases.py"]  # a submodule, not its face
    assert "hf_omni/compat/__init__.py" in graph["hf_omni/parallel/fsdp.py"]  # names the face defines
    assert "hf_omni/checkpoint/marker.py" in graph["hf_omni/checkpoint/checkpointer.py"]  # `from . import marker`
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [{"a", "b", "c"}]



def test_parallel_imports_neither_adopt_nor_hub():
    """A strategy knows modules through `modules.units` (roots, loose tensors), never the adopted model or the Hub."""
    found = sorted((src, dst) for src, dsts in import_graph().items() if src.startswith("hf_omni/parallel/")
                   for dst in dsts if dst.startswith(("hf_omni/adopt/", "hf_omni/hub/")))
    assert not found, found


def test_file_io_does_not_import_parallel():
    """`modules/` and `checkpoint/` (file I/O) import nothing under `parallel/` (design.md section 3): what both need
    about shares of tensors lives below them, in `shards/`."""
    found = sorted(f"{path} -> {target}" for path, targets in import_graph().items()
                   if path.startswith(("hf_omni/modules/", "hf_omni/checkpoint/"))
                   for target in targets if target.startswith("hf_omni/parallel/"))
    assert not found, "file I/O imports parallel/: " + "; ".join(found)


def test_shards_import_neither_file_io_nor_parallel():
    found = sorted(f"{path} -> {target}" for path, targets in import_graph().items() if path.startswith(
        "hf_omni/shards/") for target in targets if target.startswith(
        ("hf_omni/parallel/", "hf_omni/modules/", "hf_omni/checkpoint/")))
    assert not found, "; ".join(found)


# The layers, top to bottom: a file imports files of its own layer or below, never above (design.md section 3).
LAYERS = [
    ("__init__",),  # hf_omni's own face: the public names
    ("trainer", "cli"),
    ("plugin",),
    ("optim", "metrics", "testing"),
    ("compositions",),
    ("adopt", "diffusion"),
    ("modeling", "arguments", "projector"),
    ("parallel", "hub", "model_hooks", "tuning"),
    ("offline",),
    ("checkpoint",),
    ("formats",),
    ("files",),
    ("modules", "lora"),
    ("shards",),
    ("compat", "core"),
]


def _layer(path: str) -> int:
    """A file's layer: its own entry (`formats/transformers`) where it has one, else its package's."""
    parts = path.removesuffix(".py").split("/")
    for name in ("/".join(parts[1:]), parts[1]):
        found = next((i for i, names in enumerate(LAYERS) if name in names), None)
        if found is not None:
            return found
    raise AssertionError(f"{path} is in no layer")


def test_every_import_runs_down_the_layers():
    graph = import_graph()
    every = {path.split("/")[1] if path.count("/") > 1 else path.split("/")[1].removesuffix(".py") for path in graph}
    assert every <= {name for names in LAYERS for name in names}, "a package is in no layer"
    upward = sorted(f"{src} -> {dst}" for src, dsts in graph.items() for dst in dsts
                    if not src.endswith("__init__.py") and _layer(dst) < _layer(src))
    assert not upward, "imports that run up the layers: " + "; ".join(upward)
