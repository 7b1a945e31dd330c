"""Building a model class on the meta device in a given dtype: parameters on meta (buffers too, or computed for
real), the dtype as the default while the class builds, the previous default put back."""

from __future__ import annotations

import contextlib

import torch


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype | None):
    previous = torch.get_default_dtype()
    try:
        if dtype is not None and dtype.is_floating_point:
            torch.set_default_dtype(dtype)
        yield
    finally:
        torch.set_default_dtype(previous)


def meta_build(cls, config, dtype: torch.dtype | None, include_buffers: bool):
    """`cls(config)` with its parameters on the meta device (Accelerate's `init_empty_weights`)."""
    from accelerate import init_empty_weights

    with default_dtype(dtype), init_empty_weights(include_buffers=include_buffers):
        return cls(config)
