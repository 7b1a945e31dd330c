"""Injecting LoRA into a module in place (PEFT), only the adapters training, and refusing what hf_omni does not
prove yet (quantised bases, PEFT methods other than LoRA)."""

from __future__ import annotations

import logging

from torch import nn

from ..compat import inject_lora
from ..core.errors import OmniArgumentError
from .adapters import lora_config_of

logger = logging.getLogger(__name__)


def apply_lora(module: nn.Module, margs) -> bool:
    """Inject LoRA adapters in place (PEFT); only the adapters train. Returns False when the config matches no
    layer of this module and came from the top level (the module then stays fully frozen)."""
    from peft import LoraConfig

    if lora_config_of(module) is not None:  # an adapter loaded with the module: train it, do not add another
        for name, param in module.named_parameters():
            param.requires_grad_(".lora_" in name)
        return True
    if inject_lora(LoraConfig(**margs.lora), module):
        return True
    if margs.lora_from_module:
        raise OmniArgumentError(margs.name, "lora", f"matches no layer of this module (target_modules="
                                f"{margs.lora.get('target_modules')!r})")
    logger.info("hf_omni: the top-level lora matches no layer of module %r; it stays fully frozen", margs.name)
    return False


def check_supported(module: nn.Module, name: str) -> None:
    """Quantised bases (QLoRA) and PEFT methods other than LoRA are refused for now: checkpoints, exports and
    merges of them are not proven."""
    if getattr(module, "is_quantized", False) or getattr(getattr(module, "config", None), "quantization_config", None):
        raise OmniArgumentError(name, "lora", "quantised modules (QLoRA) are not supported yet")
    configs = getattr(module, "peft_config", None) or {}
    from peft import LoraConfig

    for adapter, config in configs.items():
        if adapter != "default" or type(config) is not LoraConfig:
            raise OmniArgumentError(name, "lora", f"adapter {adapter!r} is a {type(config).__name__}: only one LoRA "
                                    "adapter named 'default' is supported (no IA3, LoHa, LoKr or prompt tuning yet)")
