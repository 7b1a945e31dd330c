"""Counting the bytes a rank receives through `torch.distributed` collectives, for tests and benchmarks: "did a
rank materialise a whole module during a save?" is a question about what it received, which memory figures
(page cache, glibc's retained heap) hide.

Every collective of `torch.distributed` (and its `distributed_c10d` namespace, where `all_gather_object` and the
like look them up) is wrapped while a `ReceivedBytes` is active; each call adds what this rank receives under the
ring model (n = the group's size): all-gather (n-1)/n of the output, reduce-scatter (n-1)/n of the input,
all-reduce 2(n-1)/n, broadcast / scatter / recv the tensor on every rank but the source, gather the other ranks'
tensors on the destination. A collective inside a counted one (`all_gather_object` -> `all_gather`) counts once.
DTensor's functional collectives (`full_tensor()`, redistributions: `_c10d_functional` ops, which bypass those
functions) are counted by a dispatch mode on the thread that entered the context.
"""

from __future__ import annotations

import inspect
import threading

from ..compat import op_schema_name, resolve_process_group, torch_dispatch_mode

RING = {  # name -> (argument whose bytes count, share received by a rank of a group of n)
    "all_gather_single": ("output_tensor", lambda n, me, root: (n - 1) / n),
    "all_gather_into_tensor": ("output_tensor", lambda n, me, root: (n - 1) / n),
    "all_gather": ("tensor_list", lambda n, me, root: (n - 1) / n),
    "reduce_scatter_single": ("input", lambda n, me, root: (n - 1) / n),
    "reduce_scatter_tensor": ("input", lambda n, me, root: (n - 1) / n),
    "reduce_scatter": ("input_list", lambda n, me, root: (n - 1) / n),
    "all_reduce": ("tensor", lambda n, me, root: 2 * (n - 1) / n),
    "broadcast": ("tensor", lambda n, me, root: 0.0 if me == root else 1.0),
    "scatter": ("tensor", lambda n, me, root: 0.0 if me == root else 1.0),
    "gather": ("gather_list", lambda n, me, root: (n - 1) / n if me == root else 0.0),
    "recv": ("tensor", lambda n, me, root: 1.0),
    "irecv": ("tensor", lambda n, me, root: 1.0),
}
ROOTS = ("src", "dst", "group_src", "group_dst")
FUNCTIONAL = {  # `_c10d_functional` op -> share of its input's bytes received, given the group size n
    "all_gather_into_tensor": lambda n: n - 1, "all_gather_into_tensor_coalesced": lambda n: n - 1,
    "reduce_scatter_tensor": lambda n: (n - 1) / n, "reduce_scatter_tensor_coalesced": lambda n: (n - 1) / n,
    "all_reduce": lambda n: 2 * (n - 1) / n, "all_reduce_coalesced": lambda n: 2 * (n - 1) / n,
    "all_to_all_single": lambda n: (n - 1) / n, "broadcast": lambda n: 1.0,
}


class ReceivedBytes:
    """`with ReceivedBytes() as received: ...` then `received.total` (bytes), `received.by_name` and `received.calls`
    (name -> number of calls). `group`: count only the collectives on that process group (e.g. hf_omni's side
    group, `dist.checkpoint_group()`); the functional ones are then not counted."""

    def __init__(self, group=None):
        self.total, self.by_name, self.calls, self.group = 0.0, {}, {}, group
        self._saved, self._local, self._lock = [], threading.local(), threading.Lock()

    def __enter__(self) -> "ReceivedBytes":
        import torch.distributed as dist
        import torch.distributed.distributed_c10d as c10d

        for name, (arg, share) in RING.items():
            original = getattr(c10d, name, None)
            if original is None:
                continue
            wrapped = self._wrap(name, original, arg, share)
            for namespace in (c10d, dist):
                self._saved.append((namespace, name, getattr(namespace, name)))
                setattr(namespace, name, wrapped)
        self._mode = _functional_counter(self) if self.group is None else None
        if self._mode is not None:
            self._mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self._mode is not None:
            self._mode.__exit__(None, None, None)
        for namespace, name, original in reversed(self._saved):
            setattr(namespace, name, original)
        self._saved.clear()

    def add(self, name: str, nbytes: float) -> None:
        with self._lock:
            self.total += nbytes
            self.by_name[name] = self.by_name.get(name, 0.0) + nbytes

    def _wrap(self, name, fn, arg, share):
        import torch
        import torch.distributed as dist

        signature = inspect.signature(fn)

        def collective(*args, **kwargs):
            if getattr(self._local, "depth", 0):
                return fn(*args, **kwargs)
            bound = signature.bind(*args, **kwargs).arguments
            value = bound.get(arg)
            tensors = value if isinstance(value, (list, tuple)) else [value]
            nbytes = sum(t.numel() * t.element_size() for t in tensors if torch.is_tensor(t))
            group = bound.get("group") or dist.group.WORLD
            if self.group is not None and group is not self.group:
                return fn(*args, **kwargs)
            ranks = dist.get_process_group_ranks(group)
            root = next((bound[k] for k in ROOTS if bound.get(k) is not None), None)
            if root is not None and bound.get("group_src") is None and bound.get("group_dst") is None:
                root = ranks.index(root) if root in ranks else root
            me = ranks.index(dist.get_rank()) if dist.get_rank() in ranks else -1
            self.add(name, nbytes * share(len(ranks), me, root))
            with self._lock:
                self.calls[name] = self.calls.get(name, 0) + 1
            self._local.depth = 1
            try:
                return fn(*args, **kwargs)
            finally:
                self._local.depth = 0

        return collective


def _functional_counter(counter: ReceivedBytes):
    """A dispatch mode adding each `_c10d_functional` collective's received bytes to `counter`."""
    import torch

    class FunctionalCollectives(torch_dispatch_mode()):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            name = op_schema_name(func)
            if name.startswith("_c10d_functional::"):
                op = name.split("::", 1)[1]
                share = FUNCTIONAL.get(op)
                if share is not None:
                    inputs = args[0] if isinstance(args[0], (list, tuple)) else [args[0]]
                    nbytes = sum(t.numel() * t.element_size() for t in inputs if torch.is_tensor(t))
                    group = resolve_process_group(next(a for a in reversed(args) if isinstance(a, str)))
                    if op == "broadcast" and torch.distributed.get_rank() == args[1]:
                        nbytes = 0
                    counter.add(f"functional.{op}", nbytes * share(group.size()))
            return func(*args, **kwargs)

    return FunctionalCollectives()

