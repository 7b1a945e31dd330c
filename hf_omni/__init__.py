"""hf_omni: train multi-module models with the Hugging Face stack.

A composed model (`OmniModel`) of named HF sub-models, per-module training settings
(`OmniTrainingArguments.modules`), the Accelerate plugin that applies them (`OmniPlugin`) and a thin
`transformers.Trainer` over it (`OmniTrainer`).
"""

from .arguments import OmniTrainingArguments
from .errors import OmniArgumentError
from .module_arguments import ModuleArguments
from .config import OmniConfig
from .modeling import OmniModel
from .module_classes import register_module_class
from .offline import offline_encoder
from .plugin import OmniPlugin
from .projector import Projector, ProjectorConfig
from .trainer import OmniTrainer

__version__ = "0.1.0"

__all__ = [
    "ModuleArguments", "OmniArgumentError", "OmniConfig", "OmniModel", "OmniPlugin", "OmniTrainer",
    "OmniTrainingArguments", "Projector", "ProjectorConfig", "offline_encoder", "register_module_class",
]
