"""Scenarios run at 2 ranks (tests/scripts/mp_train.py) and at 1 rank (tests/test_multiprocess.py).

Each: "multi" (arguments at 2 ranks), "single" (at 1 rank, same global batch), optional "model" (a builder name
from helpers), "atol" (tolerance of the comparison)."""

import helpers

LORA = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]}
BASE_MODULES = {
    "vision": {"trainable": False},
    "projector": {"learning_rate": 3e-3, "max_grad_norm": 0.05},
    "llm": {"learning_rate": 1e-3, "lora": LORA, "max_grad_norm": 0.5},
}
FSDP_MODULES = {**BASE_MODULES, "llm": {**BASE_MODULES["llm"], "parallel": "fsdp"}}
GATHERED = {**BASE_MODULES, "llm": {**BASE_MODULES["llm"], "parallel": "fsdp",
                                    "fsdp_plugin": {"reshard_after_backward": False}}}
TWO_FSDP = {
    "vision": {"parallel": "fsdp", "learning_rate": 1e-3,
               "fsdp_plugin": {"transformer_cls_names_to_wrap": ["ViTLayer"], "reshard_after_forward": False}},
    "projector": {"learning_rate": 3e-3},
    "llm": {"parallel": "fsdp", "learning_rate": 1e-3,
            "fsdp_plugin": {"transformer_cls_names_to_wrap": ["LlamaDecoderLayer"],
                            "mixed_precision": {"param_dtype": "bfloat16", "reduce_dtype": "float32"}}},
}
# no fresh LoRA: a new adapter's random init is drawn per shard under empty_init, so it cannot equal 1 rank's
FULL_FSDP = {**BASE_MODULES, "llm": {"learning_rate": 1e-3, "parallel": "fsdp", "max_grad_norm": 0.5}}
METHODS = {"vision": {"parallel": "fsdp"}, "projector": {"learning_rate": 3e-3}, "llm": {"parallel": "fsdp"}}
COMMON = dict(max_steps=4, modules=BASE_MODULES)
MULTI, SINGLE = dict(per_device_train_batch_size=4), dict(per_device_train_batch_size=8)
ACCUMULATE = dict(per_device_train_batch_size=2, gradient_accumulation_steps=2)


def scenario(modules, multi=MULTI, model="tiny_model", atol=1e-6, **extra):
    return helpers.scenario(modules, multi, SINGLE, COMMON, model, atol, **extra)


SCENARIOS = {
    "ddp": scenario(BASE_MODULES),
    "ddp_accumulation": scenario(BASE_MODULES, multi=ACCUMULATE),
    # FSDP: within 1e-5 (reduce-scatter sums in another order than one process)
    "fsdp": scenario(FSDP_MODULES, atol=1e-5),
    "fsdp_accumulation": scenario(GATHERED, multi=ACCUMULATE, atol=1e-5),
    "fsdp_model_scope": scenario(BASE_MODULES, fsdp_scope="model", atol=1e-5),
    "fsdp_model_scope_accumulation": scenario(BASE_MODULES, multi=ACCUMULATE, fsdp_scope="model", atol=1e-5),
    "two_fsdp": scenario(TWO_FSDP, atol=3e-2),  # llm computes in bf16 at 2 ranks, fp32 at 1
    "fsdp_methods": scenario(METHODS, model="tiny_feature_model", atol=1e-5),
    "fsdp_empty_init": scenario(FULL_FSDP, model="empty_init_model", atol=1e-5),
    "fsdp_frozen_sharded": scenario({**FSDP_MODULES, "vision": {"trainable": False, "parallel": "fsdp"}}, atol=1e-5),
    # offline vision at 2 ranks (each encodes its rows; the sampler shards the cached rows) vs online at 1 rank
    "offline_ddp": {**scenario(BASE_MODULES), "multi": dict(COMMON, **MULTI, offline_modules=["vision"]),
                    "offline": True},
    "offline_fsdp": {**scenario(FSDP_MODULES, atol=1e-5),
                     "multi": dict(COMMON, modules=FSDP_MODULES, **MULTI, offline_modules=["vision"]), "offline": True},
}

# set in the 2-rank run's environment: hf_omni must ignore them and leave them as they are
FSDP_ENV = {"FSDP_RESHARD_AFTER_FORWARD": "false", "FSDP_TRANSFORMER_CLS_TO_WRAP": "LlamaMLP",
            "FSDP_AUTO_WRAP_POLICY": "NO_WRAP", "FSDP_CPU_RAM_EFFICIENT_LOADING": "true"}


def sharding_facts(model) -> dict:
    """Per module: parameter bytes held by this rank, and the module's full parameter bytes."""
    facts = {}
    for name, module in model.omni_modules().items():
        local = full = 0
        for p in module.parameters():
            tensor = p.to_local() if hasattr(p, "to_local") else p
            local += tensor.numel() * tensor.element_size()
            full += p.numel() * p.element_size()
        facts[name] = {"local_bytes": local, "full_bytes": full}
    return facts
