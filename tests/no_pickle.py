"""`no_unpickling()`: while it is active every way Python or torch unpickles (pickle's load / loads / Unpickler,
`torch.load`, torch's weights-only unpickler) raises `Unpickled`. Loads run inside it prove they read no pickle."""

import contextlib
import pickle

import torch
import torch._weights_only_unpickler as weights_only_unpickler
import torch.serialization


class Unpickled(AssertionError):
    pass


def _refuse(*args, **kwargs):
    raise Unpickled(f"a load path unpickled {args[:1]!r}")


class _RefusingUnpickler:
    def __init__(self, *args, **kwargs):
        _refuse(*args)


PATCHES = [(pickle, "load", _refuse), (pickle, "loads", _refuse), (pickle, "Unpickler", _RefusingUnpickler),
           (torch, "load", _refuse), (torch.serialization, "load", _refuse),
           (weights_only_unpickler, "load", _refuse), (weights_only_unpickler, "Unpickler", _RefusingUnpickler)]


@contextlib.contextmanager
def no_unpickling():
    saved = [(owner, name, getattr(owner, name)) for owner, name, _ in PATCHES]
    for owner, name, value in PATCHES:
        setattr(owner, name, value)
    try:
        yield
    finally:
        for owner, name, value in saved:
            setattr(owner, name, value)
