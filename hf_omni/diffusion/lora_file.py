"""A pipeline's LoRA in diffusers' own file: `pytorch_lora_weights.safetensors` beside `model_index.json`, written
by the pipeline class's `save_lora_weights` (each component's adapter under its name, with its `LoraConfig` as the
adapter metadata), so `PipelineClass.from_pretrained(base).load_lora_weights(folder)` gives the trained outputs.

Cost at scale: only the LoRA tensors are gathered (every rank calls `full_tensor` on each sharded one: a few MB
to a few hundred MB in all), on every rank for the length of the write; the main process writes the file."""

from __future__ import annotations

import inspect

import torch
from torch.distributed.tensor import DTensor

from ..core.errors import OmniArgumentError
from ..core.refusals import RESOLVED, refusal
from ..lora.adapters import lora_config_of
from ..lora.merge import full
from .index import is_pipeline, pipeline_class

LAYERS = "lora_layers"  # save_lora_weights' arguments: <component>_lora_layers


def lora_components(cls: type) -> list[str]:
    """The components whose LoRA the pipeline class's `save_lora_weights` takes (`<component>_lora_layers`)."""
    return [n[:-len(LAYERS) - 1] for n in inspect.signature(cls.save_lora_weights).parameters
            if n.endswith("_" + LAYERS)]


def check_lora_components(model, lora: dict) -> None:
    """Before any compute (and again at a save): every module with LoRA (`lora`: module -> its LoRA settings or
    config, or None) is one the pipeline's LoRA file holds; else an error naming the module and key."""
    if not is_pipeline(model):
        return
    cls = pipeline_class(model.config.pipeline)
    takes = lora_components(cls) if hasattr(cls, "save_lora_weights") else []
    for name, settings in lora.items():
        if settings and name not in takes:
            raise OmniArgumentError(name, "lora", f"{cls.__name__} holds LoRA of {takes} only (its "
                                    "save_lora_weights, diffusers' LoRA file): train the module fully or freeze it")


@refusal(RESOLVED)
def refuse_lora_outside_the_file(model, args) -> None:
    """LoRA written under `modules.<name>` on a component the pipeline's LoRA file does not hold."""
    check_lora_components(model, {n: s.args.lora for n, s in model.slots.items()
                                  if s.args.trainable and s.args.lora_from_module})


def adapter_state(slot) -> dict[str, torch.Tensor]:
    """The module's adapter tensors, whole (sharded ones gathered: every rank calls this), in the dtype loaded."""
    from peft import get_peft_model_state_dict

    state = {k: full(v) if isinstance(v, DTensor) else v  # gathered on the device its group serves (offload)
             for k, v in slot.module.state_dict().items() if ".lora_" in k}
    if slot.precision is not None:
        state = slot.precision.export(state)
    return {k: v.detach().to("cpu").contiguous() for k, v in get_peft_model_state_dict(slot.module,
                                                                                       state_dict=state).items()}


def write_lora_file(model, directory: str, is_main_process: bool) -> None:
    """A pipeline with LoRA modules: diffusers' LoRA file in `directory` (nothing for any other model)."""
    if not is_pipeline(model):
        return
    check_lora_components(model, {n: lora_config_of(s.module) for n, s in model.slots.items()})
    adapted = {n: s for n, s in model.slots.items() if lora_config_of(s.module) is not None}
    if not adapted:
        return
    layers = {f"{name}_{LAYERS}": adapter_state(slot) for name, slot in adapted.items()}
    if not is_main_process:
        return
    metadata = {f"{name}_lora_adapter_metadata": lora_config_of(slot.module).to_dict()
                for name, slot in adapted.items()}
    pipeline_class(model.config.pipeline).save_lora_weights(directory, **layers, **metadata)
