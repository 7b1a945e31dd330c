"""What trains inside a module, applied before it is wrapped: freeze, LoRA (`lora.inject`: PEFT, in place),
activation checkpointing (`checkpointing`); each from the module's resolved `arguments.module.ModuleArguments`
(`margs`)."""

from __future__ import annotations

from torch import nn

from ..lora.inject import apply_lora, check_supported
from .checkpointing import apply_activation_checkpointing


def freeze(module: nn.Module) -> None:
    module.requires_grad_(False)
    module.eval()


def apply_training_mode(module: nn.Module, margs) -> bool:
    """Freeze | LoRA, then activation checkpointing. Returns whether anything in the module still trains."""
    check_supported(module, margs.name)
    trainable = margs.trainable
    if trainable and margs.lora:
        freeze(module)
        trainable = apply_lora(module, margs)
    elif not trainable:
        freeze(module)
    if trainable and not any(p.requires_grad for p in module.parameters()):
        trainable = False  # nothing left to train in it: treat as fully frozen
    if trainable and margs.activation_checkpointing:
        apply_activation_checkpointing(module, margs)
    return trainable


def apply_training_modes(slots: dict) -> list[str]:
    """Freeze / LoRA / activation checkpointing of every module (`slots`: name -> its slot, its `args` resolved);
    returns the modules that still train."""
    for slot in slots.values():
        slot.trains = apply_training_mode(slot.module, slot.args)
    return [name for name, slot in slots.items() if slot.trains]
