"""Released MoE language models adopted as they are (`OmniModel.from_model`), their experts spread by expert
parallelism through the released model's own plan: Qwen2-MoE, Qwen3-MoE and a DeepSeek-V3-style model, each tiny
and random (nothing downloaded). The runs of tests/test_adopted_experts.py (1 process) and
tests/scripts/mp_adopted_experts.py (2 ranks, `ep_size: 2`): 3 steps on the same global batch of 8, a checkpoint at
step 2 resumed, the export loaded back by the released class."""

from __future__ import annotations

import os

import torch
from helpers import full_state, make_args, step_losses
from moe_runs import VOCAB, Tokens
from transformers import (
    DeepseekV3Config,
    DeepseekV3ForCausalLM,
    Qwen2MoeConfig,
    Qwen2MoeForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

from hf_omni import OmniModel, OmniTrainer

COMMON = dict(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
              max_position_embeddings=32, num_experts_per_tok=2)
FAMILIES = {
    "qwen2_moe": lambda: Qwen2MoeForCausalLM(Qwen2MoeConfig(
        **COMMON, intermediate_size=32, moe_intermediate_size=16, shared_expert_intermediate_size=32, num_experts=4)),
    "qwen3_moe": lambda: Qwen3MoeForCausalLM(Qwen3MoeConfig(
        **COMMON, intermediate_size=32, moe_intermediate_size=16, num_experts=4, head_dim=8)),
    "deepseek_v3": lambda: DeepseekV3ForCausalLM(DeepseekV3Config(
        **COMMON, intermediate_size=32, moe_intermediate_size=16, n_routed_experts=4, n_shared_experts=1,
        first_k_dense_replace=0, n_group=1, topk_group=1, q_lora_rank=None, kv_lora_rank=8, qk_rope_head_dim=4,
        qk_nope_head_dim=4, v_head_dim=8)),
}
EP = {"llm": {"parallel": "fsdp", "learning_rate": 1e-2, "parallelism": {"dp_shard_size": 2, "ep_size": 2}}}
SINGLE = {"llm": {"parallel": "fsdp", "learning_rate": 1e-2}}


def adopted(family: str):
    torch.manual_seed(0)
    return OmniModel.from_model(FAMILIES[family](), modules={"llm": ["model", "lm_head"]})


def run(out: str, family: str, modules: dict, batch: int) -> dict:
    """3 steps saving at 2, the export; the same run resumed from step 2. Every rank calls it."""
    common = dict(max_steps=3, per_device_train_batch_size=batch, modules=modules, save_strategy="steps",
                  save_steps=2)
    model, data = adopted(family), Tokens()
    trainer = OmniTrainer(model=model, args=make_args(os.path.join(out, "run"), **common), train_dataset=data)
    trainer.train()
    trainer.save_model(os.path.join(out, "export"))
    resumed = adopted(family)
    again = OmniTrainer(model=resumed, args=make_args(os.path.join(out, "resumed"), **common), train_dataset=data)
    again.train(resume_from_checkpoint=os.path.join(out, "run", "checkpoint-2"))
    experts = {k: str(p.placements) for k, p in model.released.named_parameters() if ".experts." in k
               and hasattr(p, "placements")}
    return {"losses": step_losses(trainer), "state": full_state(model), "resumed_losses": step_losses(again)[-1:],
            "resumed_state": full_state(resumed), "experts": experts}
