"""A tiny fused-MoE language model (Mixtral: 4 experts, `gate_up_proj` [4, 32, 16] and `down_proj` [4, 16, 16],
which transformers stacks on load and splits per expert on save) for the expert-placement tests: its folder saved
once, a run of 4 steps checkpointing at step 2 (`trainer`), and FSDP2's placement forced onto the experts' dim 1
(`experts_on_dim1`: at 2 ranks the placement rule keeps dim 0, 4 experts dividing evenly)."""

from __future__ import annotations

import os

import torch
from helpers import make_args
from transformers import MixtralConfig, MixtralForCausalLM

from hf_omni import OmniModel, OmniTrainer
from hf_omni.parallel import placement

VOCAB = 32
LLM = dict(vocab_size=VOCAB, hidden_size=16, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2,
           num_key_value_heads=1, num_local_experts=4, num_experts_per_tok=2)
MODULES = {"llm": {"parallel": "fsdp", "learning_rate": 1e-2}}
EXPERTS = ("model.layers.0.mlp.experts.gate_up_proj", "model.layers.0.mlp.experts.down_proj")


class LanguageModel(OmniModel):
    label_shift = True

    def forward(self, input_ids, labels=None, **kw):
        return self.llm(input_ids=input_ids, labels=labels, **kw)


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n: int = 32):
        self.ids = torch.randint(1, VOCAB, (n, 8), generator=torch.Generator().manual_seed(0))

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def experts_on_dim1() -> None:
    """Every 3-D parameter (fused experts) on dim 1 from now on in this process; the rule for the rest."""
    rule = placement.shard_dim
    placement.shard_dim = lambda shape, ranks: 1 if len(shape) == 3 and shape[1] % ranks == 0 else rule(shape, ranks)


def saved_folder(root: str) -> str:
    """The initial model as module folders (per-expert tensors in its files), written once."""
    folder = os.path.join(root, "saved")
    if not os.path.isdir(folder):
        torch.manual_seed(0)
        LanguageModel.from_modules({"llm": MixtralForCausalLM(MixtralConfig(**LLM))}).save_pretrained(folder)
    return folder


def trainer(root: str, out: str, batch: int, empty_init: bool = True, seed: int = 0) -> OmniTrainer:
    """4 steps of `batch` samples a rank, a checkpoint at step 2; the model read from `saved_folder` (`seed`: other
    weights for the loaded parts, as a resumed run would start from)."""
    model = LanguageModel.from_pretrained(saved_folder(root), empty_init=empty_init)
    if seed:
        torch.manual_seed(seed)
        for p in model.parameters():
            if not p.is_meta:
                p.data.normal_(0, 0.02)
    args = make_args(out, modules=MODULES, per_device_train_batch_size=batch, save_strategy="steps", save_steps=2)
    return OmniTrainer(model=model, args=args, train_dataset=Tokens())
