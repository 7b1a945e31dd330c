"""Host reads of device memory made by hf_omni's own code, counted by a `TorchDispatchMode`.

A read that waits for the device — `.item()`, `bool()` / `float()` of a tensor (`aten._local_scalar_dense`),
`is_nonzero`, `nonzero`, `equal`, a copy from another device to the CPU, or `Tensor.tolist()` / `.numpy()` — is a host–device synchronisation on a GPU. Each one is attributed to the innermost Python frame
outside torch: when that frame is in hf_omni (not `hf_omni/testing`), hf_omni made it; a read inside a model's own
code or Trainer's is theirs. Not counted: reads under `hf_omni.core.dist.all_gather_host` (per-step metadata built on
the host and read back as Python ints: host memory by construction) and under the logging hooks
(`OmniTrainer.log`, `OmniPlugin.log_metrics`), which run at logging steps only. On a CPU run every tensor is "device
memory", so the test is strict: no read of any tensor from hf_omni's frames at all. The authoritative GPU check is
`torch.cuda.set_sync_debug_mode("error")` (bench/gpu_check.py).
"""

from __future__ import annotations

import os
import sys

import torch

from ..compat import torch_dispatch_mode

aten = torch.ops.aten
READS = {aten._local_scalar_dense.default, aten.is_nonzero.default, aten.nonzero.default, aten.equal.default}
COPIES = {aten._to_copy.default, aten.copy_.default}
PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep  # hf_omni/
TORCH = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
TESTING = os.path.join(PACKAGE, "testing") + os.sep
STDLIB = os.path.dirname(os.path.abspath(os.__file__)) + os.sep  # contextlib, functools, ...: see through them
OPTIMIZERS = os.path.join(TORCH, "optim") + os.sep  # an optimizer's own step: its choice (torch keeps AdamW's step
# counts on the host unless capturable, so on a GPU its `.item()`s read no device memory)
EXCLUDED = {("dist.py", "all_gather_host"), ("trainer.py", "log"), ("plugin.py", "log_metrics")}


def _to_host(func, args, kwargs) -> bool:
    """A copy whose source is on another device and whose result is on the CPU."""
    if func not in COPIES:
        return False
    source = args[1] if func is aten.copy_.default else args[0]
    target = args[0].device if func is aten.copy_.default else (kwargs or {}).get("device")
    return (isinstance(source, torch.Tensor) and source.device.type != "cpu" and target is not None
            and torch.device(target).type == "cpu")


def owner() -> str | None:
    """`file:line` of the hf_omni frame that made the current op, or None (another library's code, or an excluded frame)."""
    frame = sys._getframe(2)
    found = None
    while frame is not None:
        path = os.path.abspath(frame.f_code.co_filename)
        if path.startswith(PACKAGE) and (os.path.basename(path), frame.f_code.co_name) in EXCLUDED:
            return None
        if found is None and path.startswith(OPTIMIZERS):
            return None
        through = path.startswith(TORCH) or (path.startswith(STDLIB) and "site-packages" not in path)
        if found is None and not through and path != os.path.abspath(__file__):
            if not path.startswith(PACKAGE) or path.startswith(TESTING):
                return None
            found = f"{os.path.relpath(path, os.path.dirname(PACKAGE.rstrip(os.sep)))}:{frame.f_lineno} ({frame.f_code.co_name})"
        frame = frame.f_back
    return found


class HostReads(torch_dispatch_mode()):
    """`with HostReads() as reads: ...`; then `reads.found`: `[(op, where)]` for every host read hf_omni's own code
    made inside the block (on this thread; autograd runs CPU backward on it too); `others`: how many reads other
    code made (Trainer's per-step `logging_nan_inf_filter` check, a model's own): the counter was armed."""

    def __init__(self):
        super().__init__()
        self.found: list[tuple[str, str]] = []
        self.others = 0

    def __enter__(self):
        """Also counts `Tensor.tolist()` and `Tensor.numpy()` (no aten op on a CPU tensor) while armed."""
        self.patched = {name: getattr(torch.Tensor, name) for name in ("tolist", "numpy")}
        for name, original in self.patched.items():
            setattr(torch.Tensor, name, self.counting(name, original))
        return super().__enter__()

    def __exit__(self, *exc):
        for name, original in self.patched.items():
            setattr(torch.Tensor, name, original)
        return super().__exit__(*exc)

    def counting(self, name: str, original):
        def method(tensor, *args, **kwargs):
            where = owner()
            if where is not None:
                self.found.append((f"Tensor.{name}", where))
            return original(tensor, *args, **kwargs)

        return method

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in READS or _to_host(func, args, kwargs):
            where = owner()
            if where is not None:
                self.found.append((str(func), where))
            else:
                self.others += 1
        return func(*args, **(kwargs or {}))
