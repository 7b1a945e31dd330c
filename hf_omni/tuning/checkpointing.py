"""`activation_checkpointing` of one module, through the released classes' own checkpointing (transformers' per-layer
`activation_checkpointing_enable`).

Which models' own checkpointing covers a module is its format's answer (`ModuleFormat.checkpointed_models`): a
composed module is one `PreTrainedModel`: its own. An adopted model's module (`adopt.parts.Part`, `adopt.format`)
is a container of the released model's submodules, not a model: each of its roots that is a `PreTrainedModel`
supporting it (LLaVA's `model.language_model`), else the outermost such models inside the root, checkpoint their
own layers; a root with none (`lm_head`) has nothing to recompute. A carved-out child belongs to another module:
its layers keep their own setting. Nothing to checkpoint in the whole module is refused, naming the module and
key, before any compute.
"""

from __future__ import annotations

from torch import nn

from ..compat import gradient_checkpointing_attributes
from ..core.errors import OmniArgumentError
from ..core.refusals import RESOLVED, refusal
from ..files.format import format_of

_UNSET = object()
_FLAGS = gradient_checkpointing_attributes()


def checkpointed_models(module: nn.Module) -> list[tuple[nn.Module, list[nn.Module]]]:
    """(model whose own checkpointing covers part of `module`, the carved-out submodules inside it), for each: its
    format's answer (`ModuleFormat.checkpointed_models`)."""
    return format_of(module).checkpointed_models(module)


def check_activation_checkpointing(module: nn.Module, name: str) -> list[tuple[nn.Module, list[nn.Module]]]:
    models = checkpointed_models(module)
    if not models:
        raise OmniArgumentError(name, "activation_checkpointing", format_of(module).no_checkpointing_reason(module))
    return models


@refusal(RESOLVED)
def check_checkpointed_modules(model, args) -> None:
    """Before any compute: each trained module asking for it has something to checkpoint (a module whose LoRA comes
    from the top level may yet be left frozen by it: checked when it is applied)."""
    for name, margs in ((name, slot.args) for name, slot in model.slots.items()):
        if margs.trainable and margs.activation_checkpointing and (not margs.lora or margs.lora_from_module):
            check_activation_checkpointing(model.slots[name].module, name)


def apply_activation_checkpointing(module: nn.Module, margs) -> None:
    kwargs = {"use_reentrant": False, **(margs.activation_checkpointing_kwargs or {})}
    every_n_layers, offload = kwargs.pop("every_n_layers", 1), kwargs.pop("offload", False)  # as Trainer passes
    for model, carved in check_activation_checkpointing(module, margs.name):
        kept = [(m, {k: vars(m).get(k, _UNSET) for k in _FLAGS}) for c in carved for m in c.modules()
                if hasattr(m, "gradient_checkpointing")]
        try:
            format_of(module).enable_checkpointing(model, kwargs, every_n_layers, offload)
        except ValueError as err:  # transformers: a model that has no checkpointed layer after all
            raise OmniArgumentError(margs.name, "activation_checkpointing", str(err)) from None
        for m, flags in kept:  # another module's layers: as they were
            for key, value in flags.items():
                if value is _UNSET:
                    vars(m).pop(key, None)
                else:
                    setattr(m, key, value)

