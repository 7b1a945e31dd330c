"""hf_omni: train multi-module models with the Hugging Face stack.

A composed model (`OmniModel`) of named HF sub-models, per-module training settings
(`OmniTrainingArguments.modules`), the Accelerate plugin that applies them (`OmniPlugin`) and a thin
`transformers.Trainer` over it (`OmniTrainer`).
"""

from .adopt import format as _adopted_format  # noqa: F401 (the shipped formats register on import: this one first)
from .arguments.module import ModuleArguments
from .arguments.training import OmniTrainingArguments
from .core.config import OmniConfig
from .core.errors import OmniArgumentError
from .diffusion.sampling import SampleImagesCallback
from .files.format import ModuleFormat, register_module_format
from .formats import diffusers_models as _diffusers_format  # noqa: F401
from .formats import transformers as _transformers_format  # noqa: F401
from .formats.transformers_classes import register_module_class
from .modeling import OmniModel
from .modules.ema import ema_weights
from .offline.encoder import offline_encoder
from .parallel.strategy import register_strategy
from .plugin import OmniPlugin
from .projector import Projector, ProjectorConfig
from .trainer.trainer import OmniTrainer

__version__ = "0.1.0"

__all__ = [
    "ModuleArguments", "ModuleFormat", "OmniArgumentError", "OmniConfig", "OmniModel", "OmniPlugin", "OmniTrainer",
    "OmniTrainingArguments", "Projector", "ProjectorConfig", "SampleImagesCallback", "ema_weights", "offline_encoder",
    "register_module_class", "register_module_format", "register_strategy",
]
