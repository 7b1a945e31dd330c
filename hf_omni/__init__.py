"""hf_omni: train multi-module models with the Hugging Face stack.

A composed model (`OmniModel`, `modeling`; what the driver and the checkpointer ask it, `model_hooks`) of named HF
sub-models, per-module training settings (`OmniTrainingArguments.modules`), the Accelerate plugin that applies them
(`OmniPlugin`, `plugin`), a thin `transformers.Trainer` over it (`OmniTrainer`), the `hf-omni` commands (`cli`) and
the small MLP between modules (`Projector`, `projector`). Four kinds extend it, each one file and one registration
of one shape (`core.registry`): `register_strategy`, `register_layout`, `register_module_format`,
`register_composition`. The sub-packages, lowest first: `compat`, `core`; `shards`; `modules`, `lora`; `files`;
`formats`; `checkpoint`; `offline`; `parallel`, `hub`, `tuning`; `arguments`; `adopt`, `diffusion`;
`compositions`; `optim`, `metrics`, `testing`; `trainer` (tests/test_layering.py holds the order).
"""

from . import compositions  # noqa: F401 (each composition registers on import)
from .adopt import format as _adopted_format  # noqa: F401 (the shipped formats register on import: this one first)
from .arguments.module import ModuleArguments
from .arguments.training import OmniTrainingArguments
from .core.config import OmniConfig
from .core.errors import OmniArgumentError
from .diffusion.sampling import SampleImagesCallback
from .files.composition import Composition, register_composition
from .files.format import ModuleFormat, register_module_format
from .formats import diffusers_models as _diffusers_format  # noqa: F401
from .formats import transformers as _transformers_format  # noqa: F401
from .formats.transformers_classes import register_module_class
from .modeling import OmniModel
from .modules.ema import ema_weights
from .offline.encoder import offline_encoder
from .parallel.layout import Layout, register_layout
from .parallel.strategy import Strategy, register_strategy
from .plugin import OmniPlugin
from .projector import Projector, ProjectorConfig
from .trainer.trainer import OmniTrainer

__version__ = "0.1.0"

__all__ = [
    "Composition", "Layout", "ModuleArguments", "ModuleFormat", "OmniArgumentError", "OmniConfig", "OmniModel",
    "OmniPlugin", "OmniTrainer", "OmniTrainingArguments", "Projector", "ProjectorConfig", "SampleImagesCallback",
    "Strategy", "ema_weights", "offline_encoder", "register_composition", "register_layout", "register_module_class",
    "register_module_format", "register_strategy",
]
