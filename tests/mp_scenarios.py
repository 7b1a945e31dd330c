"""Scenarios run at 2 ranks (tests/scripts/mp_train.py) and at 1 rank (tests/test_multiprocess.py)."""

import torch

LORA = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]}
BASE_MODULES = {
    "vision": {"trainable": False},
    "projector": {"learning_rate": 3e-3, "max_grad_norm": 0.05},
    "llm": {"learning_rate": 1e-3, "lora": LORA, "max_grad_norm": 0.5},
}
COMMON = dict(max_steps=4, modules=BASE_MODULES)
FSDP_MODULES = {**BASE_MODULES, "llm": {**BASE_MODULES["llm"], "parallel": "fsdp"}}

# name -> {"multi": args at 2 ranks, "single": args at 1 rank (same global batch)}
SCENARIOS = {
    "ddp": {"multi": dict(COMMON, per_device_train_batch_size=4), "single": dict(COMMON, per_device_train_batch_size=8)},
    "ddp_accumulation": {
        "multi": dict(COMMON, per_device_train_batch_size=2, gradient_accumulation_steps=2),
        "single": dict(COMMON, per_device_train_batch_size=8)},
    "fsdp": {"multi": dict(COMMON, per_device_train_batch_size=4, modules=FSDP_MODULES),
             "single": dict(COMMON, per_device_train_batch_size=8, modules=FSDP_MODULES)},
}


def full_state_dict(model) -> dict[str, torch.Tensor]:
    """Every parameter and buffer in full (sharded DTensors gathered), on CPU."""
    out = {}
    for key, value in model.state_dict().items():
        if hasattr(value, "full_tensor"):
            value = value.full_tensor()
        out[key] = value.detach().cpu().clone()
    return out
