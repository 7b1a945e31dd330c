"""`SafetensorsIndex`: which file of a module folder holds each key, each file opened when first needed."""

from __future__ import annotations

import json
import os

import torch

from ..core.dtypes import BY_SAFETENSORS_NAME
from ..core.errors import DamagedFileError
from .format import weights_names


class SafetensorsIndex:
    """Key -> file of a folder's safetensors weights (one file, or shards + index). With an index, a file is opened
    only when one of its keys is first looked at: a rank that reads rows of a few files opens only those."""

    def __init__(self, folder: str, filenames: list[str], weight_map: dict[str, str] | None = None):
        self.folder, self._handles = folder, {}
        if weight_map is None:  # no index: the files' own headers say which keys they hold
            weight_map = {key: name for name in filenames if os.path.isfile(os.path.join(folder, name))
                          for key in self._handle(name).keys()}
        for name in set(weight_map.values()):
            if os.path.basename(name) != name or name in (".", ".."):
                raise ValueError(f"{folder}: its safetensors index names {name!r}, which is not a file beside it")
        self.files = weight_map

    def _handle(self, name: str):
        if name not in self._handles:
            from safetensors import safe_open

            path = os.path.join(self.folder, name)
            try:
                self._handles[name] = safe_open(path, framework="pt")
            except Exception as err:  # safetensors raises its own error types, none naming the file
                message = f"{path} cannot be read as safetensors ({type(err).__name__}: {err}); restore it from a " \
                          "copy (a checkpoint's file: use an earlier checkpoint)"
                raise DamagedFileError(path, message) from None
        return self._handles[name]

    @property
    def where(self) -> dict:
        """Key -> its open file (opens every file)."""
        return {key: self._handle(name) for key, name in self.files.items()}

    def _slice(self, key: str, whole: bool = False):
        handle = self._handle(self.files[key])
        try:
            return handle.get_tensor(key) if whole else handle.get_slice(key)
        except Exception as err:  # safetensors raises its own error types
            raise ValueError(f"{self.folder}: {self.files[key]} does not hold {key} as its index says "
                             f"({type(err).__name__}: {err})") from None

    @classmethod
    def for_weights(cls, folder: str) -> "SafetensorsIndex":
        """The weights of a module folder, under its format's names (`formats.interface.weights_names`)."""
        weights, index = weights_names(folder)
        index = os.path.join(folder, index)
        if os.path.isfile(index):
            with open(index) as f:
                return cls(folder, [], dict(json.load(f)["weight_map"]))
        return cls(folder, [weights])

    def __contains__(self, key: str) -> bool:
        return key in self.files

    def info(self, key: str) -> tuple[tuple[int, ...], torch.dtype | None]:
        handle = self._slice(key)
        return tuple(handle.get_shape()), BY_SAFETENSORS_NAME.get(handle.get_dtype())

    def first_float_dtype(self) -> str | None:
        """The dtype name of the first floating tensor (what `from_pretrained` loads in when the config has none)."""
        for key in sorted(self.files):
            dtype = self.info(key)[1]
            if dtype is not None and dtype.is_floating_point:
                return str(dtype).removeprefix("torch.")
        return None

    def read(self, key: str, box: tuple[slice, ...] | None = None) -> torch.Tensor:
        """The whole tensor, or only its `box` (one slice per dim, `shards.box.local_box`: rows of a dim-0 shard,
        columns of a dim-1 one), read from disk alone."""
        if box is None:
            return self._slice(key, whole=True)
        return self._slice(key)[tuple(box)] if box else self._slice(key, whole=True)
