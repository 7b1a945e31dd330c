"""The index of private third-party symbols hf_omni touches (`PRIVATE_SYMBOLS`) and `resolve`, which imports one
and fails naming its library when it is gone; `hf_api.py` and `torch_api.py` build their named functions on it."""

from __future__ import annotations

import functools
import importlib

# (library, dotted path: module path, then attributes)
PRIVATE_SYMBOLS: list[tuple[str, str]] = [
    ("torch", "torch.distributed.fsdp.FSDPModule._get_fsdp_state"),
    ("torch", "torch.distributed.fsdp._fully_shard._fsdp_state.FSDPState._lazy_init"),
    ("torch", "torch.distributed._composable.replicate.replicate"),
    ("torch", "torch.distributed._composable.replicate.DDP"),
    ("torch", "torch.autograd.Variable._execution_engine"),
    ("torch", "torch.amp.grad_scaler._refresh_per_optimizer_state"),
    ("transformers", "transformers.models.auto.modeling_auto.MODEL_MAPPING._extra_content"),
    ("transformers", "transformers.core_model_loading.revert_weight_conversion"),
    ("transformers", "transformers.modeling_utils._get_tied_weight_keys"),
    ("transformers", "transformers.utils.output_capturing._CAN_RECORD_REGISTRY"),
    ("transformers", "transformers.PreTrainedModel._init_weights"),
    ("transformers", "transformers.PreTrainedModel._get_dtype_plan"),
    ("transformers", "transformers.PreTrainedModel._hf_peft_config_loaded"),
    ("transformers", "transformers.Trainer.get_decay_parameter_names"),
    ("torch", "torch.distributed.checkpoint._hf_utils.DCP_SHARDING_INFO_KEY"),
    ("torch", "torch.nn.modules.batchnorm._NormBase"),
    ("torch", "torch.utils._pytree.tree_flatten"),
    ("torch", "torch.utils._pytree.tree_unflatten"),
    ("torch", "torch.utils._python_dispatch.TorchDispatchMode"),
    ("torch", "torch.ops.aten.add.default._schema"),
    ("torch", "torch.distributed.distributed_c10d._resolve_process_group"),
    ("torch", "torch.distributed.ProcessGroupGloo._Options"),
    ("torch", "torch.distributed.ProcessGroup._get_backend"),
    ("torch", "torch.distributed.distributed_c10d._set_pg_timeout"),
    ("torch", "torch.distributed.checkpoint.hf_storage.HuggingFaceStorageReader._process_read_request"),
    ("torch", "torch.testing._internal.distributed.fake_pg.FakeStore"),
    ("torch", "torch.distributed.fsdp._fully_shard._fsdp_state.FSDPState._fsdp_param_group"),
    ("torch", "torch.distributed.tensor.placement_types._StridedShard"),
    ("torch", "torch.distributed.tensor.DTensor._spec"),
    ("torch", "torch.distributed.device_mesh.DeviceMesh._flatten"),
    ("transformers", "transformers.PreTrainedModel._keys_to_ignore_on_save"),
    ("transformers", "transformers.PreTrainedModel._tied_weights_keys"),
    ("accelerate", "accelerate.utils.fsdp_utils.fsdp2_prepare_auto_wrap_policy"),
    ("accelerate", "accelerate.utils.fsdp_utils.get_parameters_from_modules"),
    ("diffusers", "diffusers.models.modeling_utils.ModelMixin._supports_gradient_checkpointing"),
    ("transformers", "transformers.PreTrainedModel._resolve_parallel_plans"),
    ("transformers", "transformers.distributed.expert_parallel.apply_expert_parallelism"),
    ("transformers", "transformers.distributed.utils.TransformersDeviceMesh"),
    ("transformers", "transformers.distributed.fsdp.is_fsdp_managed_module"),
    ("transformers", "transformers.distributed.tensor_parallel.apply_tensor_parallelism"),
    ("transformers", "transformers.PreTrainedModel._can_set_attn_implementation"),
    ("transformers", "transformers.PretrainedConfig._attn_implementation"),
    ("torch", "torch.distributed.device_mesh.DeviceMesh._unflatten"),
    ("diffusers", "diffusers.models.modeling_utils.ModelMixin._parallel_config"),
    ("diffusers", "diffusers.models.modeling_utils.ModelMixin._cp_plan"),
    ("diffusers", "diffusers.models.attention_dispatch._AttentionBackendRegistry._is_context_parallel_available"),
    ("diffusers", "diffusers.models._modeling_parallel.ParallelConfig.setup"),
    ("diffusers", "diffusers.hooks.context_parallel.apply_context_parallel"),
    ("diffusers", "diffusers.hooks.context_parallel._get_submodule_by_name"),
    ("diffusers", "diffusers.hooks.hooks.HookRegistry.check_if_exists_or_initialize"),
    ("diffusers", "diffusers.hooks.hooks.ModelHook.post_forward"),
]


class MissingInternalError(RuntimeError):
    """A private third-party symbol hf_omni relies on is gone from the installed version."""


@functools.cache
def resolve(path: str, library: str | None = None):
    """Import the longest module prefix of `path`, then follow attributes; a clear error naming the library and
    symbol when anything is missing. Cached: the failed imports of longer prefixes cost about 0.4 ms a call, and
    some callers run every step."""
    library = library or path.split(".", 1)[0]
    parts = path.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:  # not a module at this length: try a shorter prefix (all failing raises below)
            continue
        try:
            for attr in parts[cut:]:
                obj = getattr(obj, attr)
        except AttributeError:
            break
        return obj
    raise MissingInternalError(f"hf_omni relies on {library}'s private `{path}`, which the installed {library} "
                               "lacks: install the versions in setup.cfg's ranges")


def missing_symbols() -> list[str]:
    """Each private symbol the installed libraries lack, as `library: path`."""
    out = []
    for library, path in PRIVATE_SYMBOLS:
        try:
            resolve(path, library)
        except MissingInternalError:
            out.append(f"{library}: {path}")
    return out
