"""A composed model with a module of the tests' own format (`toy_format.ToyNet`) beside a tiny Llama, its data, and
one run (train, checkpoint, resume, export, rebuild with empty_init) shared by the 1-process test and the 2-rank
script (tests/scripts/mp_toy_format.py)."""

from __future__ import annotations

import os

import torch
from helpers import full_state, make_args, step_losses
from toy_format import ToyNet
from transformers import LlamaConfig, LlamaForCausalLM

from hf_omni import OmniModel, OmniPlugin, OmniTrainer

VOCAB, HIDDEN = 16, 16
MODULES = {"toy": {"learning_rate": 1e-2, "max_grad_norm": 1.0}, "llm": {"learning_rate": 1e-3, "max_grad_norm": 1.0}}
REFERENCE = {"toy": {"lr": 1e-2, "max_norm": 1.0}, "llm": {"lr": 1e-3, "max_norm": 1.0}}


class ToyCaptioner(OmniModel):
    """The toy module's output is the LLM's first input embedding."""

    def forward(self, features, input_ids, labels=None, **kw):
        prefix = self.toy(features).unsqueeze(1)
        embeds = torch.cat([prefix, self.llm.get_input_embeddings()(input_ids)], dim=1)
        if labels is not None:
            labels = torch.cat([torch.full_like(labels[:, :1], -100), labels], dim=1)
        return self.llm(inputs_embeds=embeds, labels=labels, **kw)


def toy_model(seed: int = 0) -> ToyCaptioner:
    torch.manual_seed(seed)
    toy = ToyNet({"in_features": 6, "hidden": 12, "out_features": HIDDEN})
    llm = LlamaForCausalLM(LlamaConfig(hidden_size=HIDDEN, intermediate_size=32, num_hidden_layers=1,
                                       num_attention_heads=2, num_key_value_heads=2, vocab_size=VOCAB,
                                       max_position_embeddings=16, tie_word_embeddings=False))
    return ToyCaptioner.from_modules({"toy": toy, "llm": llm})


class ToyData(torch.utils.data.Dataset):
    def __init__(self, n: int = 64):
        generator = torch.Generator().manual_seed(0)
        self.features = torch.randn(n, 6, generator=generator)
        self.ids = torch.randint(0, VOCAB, (n, 6), generator=generator)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"features": self.features[i], "input_ids": self.ids[i], "labels": self.ids[i]}


def run(out: str, modules: dict, batch: int) -> dict:
    """4 steps saved every 2; the same run resumed from step 2; the export rebuilt with empty_init and filled as
    training would fill it. Every rank calls it; the states are full tensors on every rank."""
    common = dict(max_steps=4, per_device_train_batch_size=batch, modules=modules, save_strategy="steps",
                  save_steps=2)
    model, data = toy_model(), ToyData()
    trainer = OmniTrainer(model=model, args=make_args(os.path.join(out, "run"), **common), train_dataset=data)
    trainer.train()
    losses, state = step_losses(trainer), full_state(model)
    trainer.save_model(os.path.join(out, "export"))
    resumed = toy_model()
    again = OmniTrainer(model=resumed, args=make_args(os.path.join(out, "resumed"), **common), train_dataset=data)
    again.train(resume_from_checkpoint=os.path.join(out, "run", "checkpoint-2"))
    rebuilt = ToyCaptioner.from_pretrained(os.path.join(out, "export"), empty_init=True)
    on_meta = all(p.is_meta for p in rebuilt.toy.parameters())
    from accelerate import Accelerator

    plugin = OmniPlugin(modules=modules, defaults={}, output_dir=os.path.join(out, "filled"))
    plugin.prepare_modules(Accelerator(cpu=True), rebuilt)
    return {"losses": losses, "state": state, "resumed_losses": step_losses(again)[-2:],
            "resumed_state": full_state(resumed), "on_meta": on_meta, "filled": full_state(rebuilt),
            "sharded": {n: [type(p).__name__ for p in m.parameters()] for n, m in rebuilt.omni_modules().items()}}


def check_export(folder: str, state: dict) -> None:
    """The toy folder holds its config and weights only and loads back through ToyNet alone, equal to `state`;
    the composed model loads back whole (eager) equal too."""
    toy = os.path.join(folder, "toy")
    assert sorted(os.listdir(toy)) == ["toy_config.json", "toy_weights.safetensors"]
    alone = ToyNet.from_folder(toy).state_dict()
    assert alone.keys() == {k[len("toy."):] for k in state if k.startswith("toy.")}
    assert all(torch.equal(v, state["toy." + k]) for k, v in alone.items())
    eager = ToyCaptioner.from_pretrained(folder)
    assert type(eager.toy) is ToyNet and eager.toy.source == toy
    assert all(torch.equal(v, state[k]) for k, v in eager.state_dict().items())
