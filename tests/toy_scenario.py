"""The runs of tests/test_toy_strategy.py and tests/scripts/mp_toy_strategy.py: the projector and a LoRA llm under
one `parallel:` value, the vision tower frozen (sharded too: its own entry asks)."""

LORA = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]}  # scaling 2


def modules(parallel: str) -> dict:
    return {"vision": {"trainable": False, "parallel": parallel},  # frozen, sharded since its entry asks
            "projector": {"learning_rate": 3e-3, "parallel": parallel},
            "llm": {"learning_rate": 1e-3, "lora": LORA, "parallel": parallel, "warmup_steps": 2}}


# empty_init: the llm fully trained (every tensor read by columns), the projector too
EMPTY_INIT_MODULES = {"vision": {"trainable": False}, "projector": {"learning_rate": 3e-3, "parallel": "fsdp_dim1"},
                      "llm": {"learning_rate": 1e-3, "parallel": "fsdp_dim1"}}
