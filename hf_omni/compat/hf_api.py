"""transformers / accelerate / peft / datasets internals hf_omni relies on, each behind a named function
(indexed in `hf_omni.compat`)."""

from __future__ import annotations

import importlib
import sys

import torch
from torch import nn

from .symbols import MissingInternalError, resolve


# -- transformers ---------------------------------------------------------------------------------------
def registered_auto_classes() -> list[type]:
    """Model classes users registered with an Auto class (`AutoModel.register`)."""
    from transformers.models.auto import modeling_auto

    resolve("transformers.models.auto.modeling_auto.MODEL_MAPPING._extra_content")
    mapping_type = type(modeling_auto.MODEL_MAPPING)
    found = []
    for name in dir(modeling_auto):
        mapping = getattr(modeling_auto, name)
        if isinstance(mapping, mapping_type):
            found += list(mapping._extra_content.values())
    return found


def no_split_modules(module: nn.Module) -> set[str]:
    """The layer classes transformers and diffusers keep whole (`_no_split_modules` of every transformers or diffusers
    model inside `module`), those present in it: FSDP's default wrap units."""
    from transformers import PreTrainedModel

    models = (PreTrainedModel,)
    if "diffusers" in sys.modules:  # a diffusers model exists only once diffusers is imported: never import it here
        models += (importlib.import_module("diffusers.models.modeling_utils").ModelMixin,)
    present = {type(m).__name__ for m in module.modules()}
    names = set()
    for sub in module.modules():
        if isinstance(sub, models):
            names.update(getattr(sub, "_no_split_modules", None) or [])
    return names & present


def transformers_save_keys(module: nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`state` under the keys transformers' `save_pretrained` writes it (its save-time key conversion: ViT's
    `layers.0.attention.q_proj` is saved as `encoder.layer.0.attention.attention.query`; MoE experts merged on load
    are split again). Renamed tensors keep their identity; merged or split ones are new tensors."""
    from transformers import PreTrainedModel

    if not isinstance(module, PreTrainedModel):
        return dict(state)
    return resolve("transformers.core_model_loading.revert_weight_conversion")(module, dict(state))


def tied_weight_patterns(module: nn.Module) -> list[str]:
    """Key patterns a save drops when they alias another key (every submodule's `_tied_weights_keys`)."""
    return list(resolve("transformers.modeling_utils._get_tied_weight_keys")(module))


def keep_in_fp32_plan(module: nn.Module, dtype: torch.dtype) -> list[str]:
    """The name patterns `from_pretrained` loads in float32 when the model loads in `dtype` (its dtype plan from
    `_keep_in_fp32_modules` / `_keep_in_fp32_modules_strict`)."""
    resolve("transformers.PreTrainedModel._get_dtype_plan")
    return [pattern for pattern, kept in module._get_dtype_plan(dtype).items() if kept == torch.float32]


def config_commit_hash(config) -> str | None:
    """The Hub commit transformers recorded a config was loaded at (`_commit_hash`), where it still records one."""
    return getattr(config, "_commit_hash", None)


def config_name_or_path(config) -> str:
    """Where a config was loaded from (`_name_or_path`: a Hub id or a folder; "" when not recorded)."""
    return getattr(config, "_name_or_path", "") or ""


def keys_to_ignore_on_save(module: nn.Module) -> list[str]:
    """The state-dict keys `save_pretrained` leaves out for this model class (`_keys_to_ignore_on_save`)."""
    return getattr(module, "_keys_to_ignore_on_save", None) or []


def copy_tied_weights_keys(source: nn.Module, target: nn.Module) -> None:
    """Give `target` the tied-weight names of `source` (`_tied_weights_keys`; None when it has none)."""
    target._tied_weights_keys = getattr(source, "_tied_weights_keys", None)


def supports_block_checkpointing(module: nn.Module) -> bool:
    """A diffusers model whose blocks its `enable_gradient_checkpointing` checkpoints (`_supports_...`)."""
    return bool(getattr(module, "_supports_gradient_checkpointing", False))


def has_init_weights(module: nn.Module) -> bool:
    """The model has its own initialisation of submodules (`_init_weights`, what `init_weights` calls)."""
    return hasattr(module, "_init_weights")


def gradient_checkpointing_attributes() -> tuple[str, ...]:
    """The attributes `gradient_checkpointing_enable` sets on each checkpointed layer."""
    return ("gradient_checkpointing", "_gradient_checkpointing_func")


def init_weights(module: nn.Module, sub: nn.Module) -> None:
    """The model's own initialisation of one of its submodules."""
    resolve("transformers.PreTrainedModel._init_weights")
    module._init_weights(sub)


def adopt_loaded_adapter(module: nn.Module) -> None:
    """`from_pretrained` loaded an adapter found beside the weights and marked the model as a transformers PEFT
    integration; unmark it so `save_pretrained` writes its base weights too (hf_omni writes the adapter)."""
    resolve("transformers.PreTrainedModel._hf_peft_config_loaded")
    module._hf_peft_config_loaded = False


def decay_parameter_names(module: nn.Module) -> set[str]:
    """The parameters Trainer applies weight decay to (not biases, not norms), for any module. Trainer's method
    does not use its instance."""
    from transformers import Trainer

    return set(Trainer.get_decay_parameter_names(None, module))


# -- accelerate -----------------------------------------------------------------------------------------
def fsdp2_auto_wrap_policy(plugin, module: nn.Module):
    """Accelerate's FSDP2 wrap policy for `plugin` over `module` (a callable, or None)."""
    return resolve("accelerate.utils.fsdp_utils.fsdp2_prepare_auto_wrap_policy")(plugin, module)


def fsdp_ignored_params(ignored_modules, module: nn.Module, device: torch.device):
    return resolve("accelerate.utils.fsdp_utils.get_parameters_from_modules")(ignored_modules, module, device)


# -- peft -----------------------------------------------------------------------------------------------
NO_TARGET_MESSAGES = ("not found in the base model", "No modules were targeted")


def keep_output_recording(module: nn.Module) -> None:
    """transformers records `output_hidden_states` / `output_attentions` through hooks it finds by each model
    class's name (`_can_record_outputs`, registered at construction); an in-place wrap swaps in a generated subclass
    (`FSDPCLIPVisionModel`) whose name it has not seen, and the outputs come back None (LLaVA's feature layer).
    Register each wrapped submodel under its new class too."""
    from transformers import PreTrainedModel

    registry = resolve("transformers.utils.output_capturing._CAN_RECORD_REGISTRY")
    for sub in module.modules():
        if isinstance(sub, PreTrainedModel) and str(type(sub)) not in registry:
            registry[sub] = getattr(sub, "_can_record_outputs", None)


def inject_lora(config, module: nn.Module) -> bool:
    """Inject LoRA adapters in place; False when `config` matches no layer of `module` (PEFT says so only in
    its error message)."""
    from peft import inject_adapter_in_model

    try:
        inject_adapter_in_model(config, module)
    except ValueError as err:
        if any(message in str(err) for message in NO_TARGET_MESSAGES):
            return False
        raise
    return True


def init_lora_layer(layer: nn.Module, config) -> None:
    """A fresh adapter's initialisation for one PEFT LoRA layer whose base weights are now real (`empty_init`
    injects adapters on the meta device): PEFT's reset, then its variant's own init (DoRA: the magnitude
    vector is the base weight's norm)."""
    layer.reset_lora_parameters("default", config.init_lora_weights)
    if config.init_lora_weights is False:  # PEFT leaves these to the constructors, which ran on meta
        for name in ("lora_A", "lora_B"):
            if "default" in getattr(layer, name):
                getattr(layer, name)["default"].reset_parameters()
        for name in ("lora_embedding_A", "lora_embedding_B"):
            if "default" in getattr(layer, name, {}):
                torch.nn.init.normal_(getattr(layer, name)["default"])
    variants = getattr(layer, "lora_variant", None)
    if variants is None:
        raise MissingInternalError("hf_omni relies on peft's LoraLayer.lora_variant, which the installed peft lacks")
    if "default" in variants:
        variants["default"].init(layer, adapter_name="default", config=config)


def dataset_fingerprint(dataset) -> str | None:
    """A `datasets.Dataset`'s own fingerprint (the private `_fingerprint` instance attribute, which every transform
    changes; checked by behaviour in tests/test_compat.py); None for any other dataset."""
    from datasets import Dataset

    if not isinstance(dataset, Dataset):
        return None
    value = getattr(dataset, "_fingerprint", None)
    if not isinstance(value, str):
        raise MissingInternalError("hf_omni relies on datasets.Dataset._fingerprint, which the installed datasets "
                                   "lacks")
    return value
