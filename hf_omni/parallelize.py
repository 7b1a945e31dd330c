"""How one module is treated, as named helpers applied in a fixed order (torchtitan style):

    freeze | LoRA  ->  activation checkpointing  ->  wrap in place (FSDP2 | replicate | none)

Wrapping is in place: `model.<name>` keeps its class (a generated subclass) and its methods.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist
from torch import nn

from .arguments import ModuleArguments, OmniArgumentError

logger = logging.getLogger(__name__)


def has_process_group() -> bool:
    """`torchrun` / `accelerate launch --multi_gpu` make one (world size 1 included); plain `python` does not."""
    return dist.is_available() and dist.is_initialized()


def freeze(module: nn.Module) -> None:
    module.requires_grad_(False)
    module.eval()


def apply_lora(module: nn.Module, margs: ModuleArguments) -> bool:
    """Inject LoRA adapters in place (PEFT); only the adapters train. Returns False when the config matches no
    layer of this module and came from the top level (the module then stays fully frozen)."""
    from peft import LoraConfig, inject_adapter_in_model

    from .export import lora_config_of

    if lora_config_of(module) is not None:  # an adapter loaded with the module: train it, do not add another
        for name, param in module.named_parameters():
            param.requires_grad_(".lora_" in name)
        return True
    try:
        inject_adapter_in_model(LoraConfig(**margs.lora), module)
    except ValueError as err:
        if "not found in the base model" not in str(err) and "No modules were targeted" not in str(err):
            raise
        if margs.lora_from_module:
            raise OmniArgumentError(margs.name, "lora", f"matches no layer of this module ({err})") from None
        logger.info("hf_omni: the top-level lora matches no layer of module %r; it stays fully frozen", margs.name)
        return False
    return True


def apply_activation_checkpointing(module: nn.Module, margs: ModuleArguments) -> None:
    if not getattr(module, "supports_gradient_checkpointing", False):
        raise OmniArgumentError(margs.name, "activation_checkpointing",
                                f"{type(module).__name__} does not support activation checkpointing")
    module.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})


def replicate_module(module: nn.Module, device: torch.device) -> nn.Module:
    """Data parallel in place with torch's composable `replicate` (DDP's bucketed all-reduce, no wrapper
    object). Initialised now, so parameters are broadcast from rank 0 before any method of the module runs
    (the composed forward may call `get_input_embeddings()` before the module's own forward)."""
    from torch.distributed._composable.replicate import replicate

    kwargs = {"device_id": device} if device.type != "cpu" else {}
    replicate(module, **kwargs)
    replicate.state(module).lazy_init()
    return module


def wrap_module(module: nn.Module, parallel: str, device: torch.device, fsdp_plugin=None,
                lazy_init: bool = True) -> str:
    """Wrap a module in place as `parallel` says; returns what was applied ("fsdp" | "ddp" | "none")."""
    if parallel == "ddp":
        replicate_module(module, device)
    elif parallel == "fsdp":
        from .fsdp import shard_module

        shard_module(module, fsdp_plugin, device, lazy_init=lazy_init)
    return parallel
