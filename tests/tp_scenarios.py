"""Tensor parallelism per module (tests/scripts/mp_tp.py at 2 / 4 ranks against one process, tests/test_tp.py): the
tiny captioner's Llama split by its transformers plan inside a data-parallel composed model. The composed forward
computes the loss from the LM's logits (the LM returns one row per input row: the boundary keeps each rank's)."""

import helpers
import torch
from transformers.modeling_outputs import CausalLMOutput

from hf_omni.testing.digits import Captioner


class RowLossCaptioner(Captioner):
    """Captioner whose loss is taken outside the LM, from its logits (no `**kw`: Trainer passes no loss kwargs)."""

    def forward(self, input_ids, pixel_values=None, labels=None):
        prefix = self.projector(self.encode_image(pixel_values))
        embeds = torch.cat([prefix, self.llm.get_input_embeddings()(input_ids)], dim=1)
        logits = self.llm(inputs_embeds=embeds, use_cache=False).logits
        loss = None
        if labels is not None:
            labels = torch.cat([labels.new_full(prefix.shape[:2], -100), labels], dim=1)
            loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten())
        return CausalLMOutput(loss=loss, logits=logits)


def tp_model(seed: int = 0, tied: bool = False, moe: bool = False) -> RowLossCaptioner:
    """The tiny captioner; `tied`: its Llama with tied input embeddings and LM head (the same seed); `moe`: a
    Qwen2-MoE language model of the same width instead (6 fused experts, top 2, a shared expert)."""
    base = helpers.tiny_model(seed)
    modules = base.omni_modules()
    if moe:
        from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

        llama = modules["llm"].config
        torch.manual_seed(seed)
        modules["llm"] = Qwen2MoeForCausalLM(Qwen2MoeConfig(
            vocab_size=llama.vocab_size, hidden_size=llama.hidden_size, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, intermediate_size=64, moe_intermediate_size=32, shared_expert_intermediate_size=64,
            num_experts=6, num_experts_per_tok=2, max_position_embeddings=64))
    if tied:
        from transformers import LlamaForCausalLM

        config = modules["llm"].config
        config.tie_word_embeddings = True
        torch.manual_seed(seed)
        modules["llm"] = LlamaForCausalLM(config)
    return RowLossCaptioner.from_modules(modules, processors=base.processors)


def llm(parallelism: dict, **extra) -> dict:
    return {"vision": {"learning_rate": 1e-3}, "projector": {"learning_rate": 3e-3},
            "llm": {"learning_rate": 1e-3, "parallel": "fsdp", "parallelism": parallelism, **extra}}


COMMON = dict(max_steps=3)
TP2, DP2_TP2 = {"dp_shard_size": 1, "tp_size": 2}, {"dp_shard_size": 2, "tp_size": 2}
SCENARIOS = {  # name: (processes, modules, multi-rank arguments); one process runs the same global batch of 8
    "tp2": (2, llm(TP2, max_grad_norm=0.5), dict(per_device_train_batch_size=4)),
    "dp2_tp2": (4, llm(DP2_TP2, max_grad_norm=0.5, ema={"decay": 0.8}), dict(per_device_train_batch_size=2)),
    # accumulation windows (the boundary's collectives run every micro-step) and activation checkpointing (the
    # recompute runs the split layers' collectives again)
    "tp2_accumulation_ac": (2, llm(TP2, activation_checkpointing=True),
                            dict(per_device_train_batch_size=2, gradient_accumulation_steps=2)),
}


# expert parallelism: the Qwen2-MoE language model's 6 experts over 2 ranks, each rank its own rows (2 ranks: every
# expert whole on one rank, with accumulation windows and activation checkpointing; 4 ranks: each pair of ranks
# holding the same 3 experts shards them on dim 1, which 2 divides); every module clipped to one global norm over several meshes (plain, dense,
# the experts')
SCENARIOS["ep2"] = (2, llm({"dp_shard_size": 2, "ep_size": 2}, activation_checkpointing=True),  # recomputes routing
                    dict(per_device_train_batch_size=2, gradient_accumulation_steps=2))
SCENARIOS["dp4_ep2"] = (4, llm({"dp_shard_size": 4, "ep_size": 2}, ema={"decay": 0.8}),
                        dict(per_device_train_batch_size=2))
# HSDP: the experts over one efsdp rank, their replicas all-reduced (the divide factor applied once)
SCENARIOS["hsdp_ep2"] = (4, llm({"dp_replicate_size": 2, "dp_shard_size": 2, "ep_size": 2}),
                         dict(per_device_train_batch_size=2))
# tensor and expert parallelism in one module: the Qwen2-MoE's attention split over tp 2, its experts over ep 2 (each
# TP group one expert group: its ranks send disjoint slices of the group's rows), FSDP2 over dp_shard 2 for the rest
SCENARIOS["dp2_tp2_ep2"] = (4, llm({"dp_shard_size": 2, "tp_size": 2, "ep_size": 2}),
                            dict(per_device_train_batch_size=2))
MOE = {"ep2", "dp4_ep2", "hsdp_ep2", "dp2_tp2_ep2"}
EMA = {"dp2_tp2", "dp4_ep2"}  # the llm's EMA shadows split like it: updated, checkpointed and resumed
# bf16 compute on a Llama saved in bf16: fp32 masters split by tp, gathered in bf16, exported in bf16
SCENARIOS["tp2_bf16"] = (2, llm(TP2, max_grad_norm=0.5), dict(per_device_train_batch_size=4))
# the same with the Qwen2-MoE at ep 2: fp32 masters of the spread experts (their own FSDP2 unit) and of the rest
SCENARIOS["ep2_bf16"] = (2, llm({"dp_shard_size": 2, "ep_size": 2}), dict(per_device_train_batch_size=4))
MOE |= {"ep2_bf16"}
BF16 = {"tp2_bf16", "ep2_bf16"}
# the README's own model: its LLM computes the loss from `labels` with Trainer's global token count (a scalar inside the
# split module: each rank reports its share)
SCENARIOS["dp2_tp2_labels"] = (4, llm(DP2_TP2, max_grad_norm=0.5), dict(per_device_train_batch_size=2))
LABELS = {"dp2_tp2_labels"}
TIED = {"tp2_tied"}  # scenarios whose Llama ties its embeddings and LM head (split once, saved once, resumed tied;
# saved by the writer thread, `save`)
SCENARIOS["tp2_tied"] = (2, llm(TP2), dict(per_device_train_batch_size=4))
# LoRA on the split LLM: adapters on column-wise (q, v, up, the LM head) and row-wise (o, down) layers, each split like
# its base layer from one seeded draw; exported unmerged and merged (`merge`)
LORA = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj", "o_proj", "up_proj", "down_proj", "lm_head"],
        "init_lora_weights": False}  # lora_B drawn too: every adapter moves the loss from the first step
SCENARIOS["dp2_tp2_lora"] = (4, llm(DP2_TP2, max_grad_norm=0.5, lora=LORA, learning_rate=1e-2),
                             dict(per_device_train_batch_size=2))
# LoRA on an expert-parallel module's dense layers (attention, the shared expert), its fused experts frozen and spread
DENSE = {**LORA, "target_modules": ["q_proj", "v_proj", "o_proj", "up_proj", "down_proj"]}
SCENARIOS["dp4_ep2_lora"] = (4, llm({"dp_shard_size": 4, "ep_size": 2}, learning_rate=3e-3, lora=DENSE),
                             dict(per_device_train_batch_size=2))
MOE |= {"dp4_ep2_lora"}
LORAS = {"dp2_tp2_lora"}
# sequence parallelism (Ulysses): the LLM's group runs the group's rows, each rank on half the positions; no weight
# split (FSDP2 over dp_shard x sp); the README's model with its loss from `labels`, accumulation with activation
# checkpointing (the recompute runs the all-to-alls again), EMA, LoRA, bf16
SP2, DP2_SP2 = {"dp_shard_size": 1, "sp_size": 2}, {"dp_shard_size": 2, "sp_size": 2}
SCENARIOS["sp2"] = (2, llm(SP2, max_grad_norm=0.5), dict(per_device_train_batch_size=4))
SCENARIOS["dp2_sp2_labels"] = (4, llm(DP2_SP2, max_grad_norm=0.5, ema={"decay": 0.8}),
                               dict(per_device_train_batch_size=2))
SCENARIOS["sp2_accumulation_ac"] = (2, llm(SP2, activation_checkpointing=True),
                                    dict(per_device_train_batch_size=2, gradient_accumulation_steps=2))
SCENARIOS["sp2_lora"] = (2, llm(SP2, lora=LORA, learning_rate=3e-3), dict(per_device_train_batch_size=4))
SCENARIOS["sp2_bf16"] = (2, llm(SP2), dict(per_device_train_batch_size=4))
LABELS |= {"dp2_sp2_labels"}
EMA |= {"dp2_sp2_labels"}
BF16 |= {"sp2_bf16"}
SEQUENCE = {"sp2", "dp2_sp2_labels", "sp2_accumulation_ac", "sp2_lora", "sp2_bf16", "dp2_sp2_to_dp2"}
ELASTIC = {  # name: (processes, the scenario whose checkpoint-2 it resumes, modules, multi-rank arguments); the 4-rank
    # launch runs first: its checkpoints are resumed at 4 ranks without tensor parallelism and at 2 ranks
    "dp2_tp2_to_dp4": (4, "dp2_tp2", llm({"dp_shard_size": 4}, max_grad_norm=0.5), dict(per_device_train_batch_size=2)),
    "dp2_tp2_to_dp2": (2, "dp2_tp2", llm({"dp_shard_size": 2}, max_grad_norm=0.5), dict(per_device_train_batch_size=4)),
    "dp4_ep2_to_ep2": (2, "dp4_ep2", *SCENARIOS["ep2"][1:]),
    "dp2_sp2_to_dp2": (2, "dp2_sp2_labels", llm({"dp_shard_size": 2}, max_grad_norm=0.5, ema={"decay": 0.8}),
                       dict(per_device_train_batch_size=4)),
}
LABELS |= {"dp2_sp2_to_dp2"}
MOE |= {"dp4_ep2_to_ep2"}


def model(name: str, seed: int = 0) -> Captioner:
    """The scenario's model (`seed`: 7 for a run whose every weight comes from a checkpoint)."""
    if name in LABELS:
        return helpers.tiny_model(seed)
    built = tp_model(seed, tied=name in TIED, moe=name in MOE)
    if name in BF16:
        built.llm.to(torch.bfloat16)  # as loaded from bf16 files
    return built


def both(name: str) -> dict:
    """Arguments of the scenario's multi-rank and one-process runs alike."""
    return {**(dict(grad_clip_scope="global", max_grad_norm=0.5) if name in MOE else {}),
            **(dict(bf16=True) if name in BF16 else {})}


def args(out_dir, name: str, single: bool = False, **extra):
    _, modules, multi = SCENARIOS[name] if name in SCENARIOS else (None, *ELASTIC[name][2:])
    return helpers.make_args(out_dir, modules=modules, **{**COMMON, **both(name), **extra},
                             **(dict(per_device_train_batch_size=8) if single else multi))


def save(name: str) -> dict:
    """The multi-rank runs' checkpoint-2 (resumed there and in one process); tp2_tied saves asynchronously."""
    return dict(save_strategy="steps", save_steps=2, save_async=name == "tp2_tied")


GENERATE = {"tp2": (6, 6), "ep2": (3, 6)}  # the trained llm's `generate` per rank: max_new_tokens of ranks 0 and 1
# (ep2: rank 0 stops first and keeps joining the experts' all-to-alls until rank 1 is done, `synced_gpus`)


def prompts(rank: int, vocab: int) -> torch.Tensor:
    """Rank `rank`'s two prompts of 4 tokens for `generate` (rank 2's: the two after)."""
    every = torch.randint(3, vocab, (8, 4), generator=torch.Generator().manual_seed(3))
    return every[2 * rank: 2 * rank + 2]


def generate(llm, rank: int, name: str) -> torch.Tensor:
    """In eval mode, as loaded (in train mode with activation checkpointing transformers 5.23 drops the cache)."""
    new, training = GENERATE[name][rank], llm.training
    llm.eval()
    try:
        with torch.no_grad():
            return llm.generate(input_ids=prompts(rank, llm.config.vocab_size), do_sample=False, max_new_tokens=new,
                                min_new_tokens=new, pad_token_id=0)
    finally:
        llm.train(training)

