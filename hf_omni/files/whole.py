"""Whole copies of a module on one rank, where nothing else holds one: reading tensors through transformers' own
loading (`weights.read_through_transformers`: the whole module on every rank) and a LoRA merge PEFT must do itself
(`folder.save_merged`: the gathered module plus its merged copy on the main process, about twice the module).
Every other load and save keeps to P / world + max(64 MB, the largest tensor) per rank (P: the module's bytes);
these two cannot, so they are allowed up to `WHOLE_COPY_LIMIT` bytes of module and refused above it, before any
tensor is gathered or loaded, with what to use instead."""

from __future__ import annotations

from torch import nn

WHOLE_COPY_LIMIT = 4 * 2**30  # bytes of module (a 1B-parameter module in fp32): 8 ranks of a node hold 32 GiB


def module_bytes(module: nn.Module, dtypes: dict | None = None) -> int:
    """The bytes of `module`'s parameters (tied ones once) and persistent buffers, in full (a DTensor's global
    size), each in its dtype now or, by name, in `dtypes` (the dtype a master weight is exported in)."""
    from .saved_keys import module_tensors

    dtypes = dtypes or {}
    return sum(t.numel() * dtypes.get(n, t.dtype).itemsize for n, t in module_tensors(module).items())


def check_whole_copy(module: nn.Module, module_name: str, what: str, instead: str, dtypes: dict | None = None) -> None:
    """Refuse `what` (a whole copy of `module`, its tensors in their dtype or `dtypes`'s) when the module is larger
    than `WHOLE_COPY_LIMIT`: the error names the module, its size, the limit, and `instead`."""
    size = module_bytes(module, dtypes)
    if size > WHOLE_COPY_LIMIT:
        raise ValueError(f"module {module_name!r}: {what} holds a whole copy of the module ({size / 2**30:.2f} GiB), "
                         f"above hf_omni's limit for whole copies ({WHOLE_COPY_LIMIT / 2**30:.2f} GiB, "
                         f"hf_omni.files.whole.WHOLE_COPY_LIMIT); {instead}")
