"""A module format of the tests' own, as a user would add one: this file plus its `register_module_format`.

`ToyNet` is a plain `torch.nn.Module` (no transformers class, no `.config`) whose folder holds `toy_config.json`
(its settings and the dtype its weights are in) and `toy_weights.safetensors` (its state dict as is; sharded:
`toy_weights-00001-of-00002.safetensors` + `toy_weights.safetensors.index.json`). It loads back through its own
class alone (`ToyNet.from_folder`).
"""

from __future__ import annotations

import json
import os

import torch
from torch import nn

import hf_omni

CONFIG, WEIGHTS, INDEX = "toy_config.json", "toy_weights.safetensors", "toy_weights.safetensors.index.json"


class ToyNet(nn.Module):
    """features (B, in_features) -> (B, out_features): a linear layer, a layer norm, a linear head, scaled by a
    persistent buffer."""

    def __init__(self, settings: dict):
        super().__init__()
        self.settings = {k: settings[k] for k in ("in_features", "hidden", "out_features")}
        self.source = ""  # the folder it was loaded from
        self.proj = nn.Linear(settings["in_features"], settings["hidden"])
        self.norm = nn.LayerNorm(settings["hidden"])
        self.head = nn.Linear(settings["hidden"], settings["out_features"])
        self.register_buffer("scale", torch.full((settings["out_features"],), 0.5))

    def forward(self, features):
        return self.head(torch.tanh(self.norm(self.proj(features)))) * self.scale

    @staticmethod
    def read_settings(folder: str) -> dict:
        with open(os.path.join(folder, CONFIG)) as f:
            return json.load(f)

    @classmethod
    def from_folder(cls, folder: str) -> "ToyNet":
        """The module of a toy folder, in the dtype its config records, with nothing of hf_omni."""
        from safetensors.torch import load_file

        settings = cls.read_settings(folder)
        model = cls(settings).to(getattr(torch, settings.get("dtype", "float32")))
        names = [WEIGHTS]
        if os.path.isfile(os.path.join(folder, INDEX)):
            with open(os.path.join(folder, INDEX)) as f:
                names = sorted(set(json.load(f)["weight_map"].values()))
        state = {k: v for name in names for k, v in load_file(os.path.join(folder, name)).items()}
        model.load_state_dict(state, strict=True)
        model.source = folder
        return model

    def save_folder(self, folder: str) -> None:
        from safetensors.torch import save_file

        os.makedirs(folder, exist_ok=True)
        ToyFormat().write_config(self, folder, next(self.parameters()).dtype)
        save_file({k: v.detach().contiguous() for k, v in self.state_dict().items()}, os.path.join(folder, WEIGHTS))


@hf_omni.register_module_format
class ToyFormat(hf_omni.ModuleFormat):
    name = "toy"
    config_files = (CONFIG,)
    weights_pattern = "toy_weights{suffix}.safetensors"
    weights_index = INDEX

    def handles(self, cls: type) -> bool:
        return issubclass(cls, ToyNet)

    def resolve(self, record: str) -> type | None:
        return ToyNet if record == "ToyNet" else None

    def load(self, cls: type, folder: str, dtype=None, device_map=None) -> nn.Module:
        return cls.from_folder(folder).to(device=device_map, dtype=dtype)

    def build_empty(self, cls: type, folder: str, name_or_path: str) -> nn.Module:
        settings = cls.read_settings(folder)
        with torch.device("meta"):
            model = cls(settings).to(getattr(torch, settings.get("dtype", "float32")))
        model.source = name_or_path
        return model

    def write_config(self, module: nn.Module, folder: str, dtype=None) -> None:
        dtype = dtype or next(module.parameters()).dtype
        with open(os.path.join(folder, CONFIG), "w") as f:
            json.dump({**module.settings, "dtype": str(dtype).removeprefix("torch.")}, f, indent=2, sort_keys=True)

    def describe(self, module: nn.Module) -> dict:
        return dict(module.settings)

    def source_path(self, module: nn.Module) -> str:
        return module.source

    def card_usage(self, record: str, repo_id: str, subfolder: str | None) -> list[str]:
        return ["This module alone: download the folder and call `toy_format.ToyNet.from_folder(folder)`.", ""]
