"""Every TrainingArguments field has a stated fate (hf_omni/trainer_fields.py); the fields whose effect depends on
the model are checked against the same computation done by hand: label smoothing on the composed model's own
targets, NEFTune noise on the LLM's token embeddings, tokens seen, length grouping, `use_cache`, activation
checkpointing's `every_n_layers`; refused fields fail at parse time naming the field."""

import copy
import dataclasses
import os

import pytest
import torch
from helpers import Captioner, make_args, tiny_data, tiny_model
from torch.nn import functional as F
from transformers import TrainerCallback, TrainingArguments

from hf_omni import OmniArgumentError, OmniTrainer, OmniTrainingArguments
from hf_omni.arguments.fields import REFUSALS, fates_table, unknown_fields

MODULES = {"vision": {"trainable": False}}


def test_every_trainer_field_has_a_fate():
    assert unknown_fields() == ([], [])

    @dataclasses.dataclass
    class Newer(TrainingArguments):
        shiny_new_switch: bool = False

    assert unknown_fields(Newer) == (["shiny_new_switch"], [])


def test_the_docs_table_is_generated_from_the_fates():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with open(os.path.join(root, "docs", "configuration.md")) as f:
        assert fates_table() in f.read(), "docs/configuration.md's field table is not trainer_fields.fates_table()"


REFUSED_VALUES = {"fsdp": "full_shard", "fsdp_config": {}, "deepspeed": {}, "torch_compile": True,
                  "torch_compile_backend": "inductor", "torch_compile_mode": "default", "use_liger_kernel": True,
                  "liger_kernel_config": {}, "save_on_each_node": True, "optim_target_modules": ["q_proj"]}


@pytest.mark.parametrize("field", sorted(set(REFUSALS) - {"fp16", "parallelism_config"}))
def test_refused_fields_fail_at_parse_time_naming_the_field(tmp_path, field):
    with pytest.raises(OmniArgumentError, match=rf"^{field}: "):
        OmniTrainingArguments(output_dir=str(tmp_path), use_cpu=True, **{field: REFUSED_VALUES[field]})


@pytest.mark.parametrize("variable,value", [("ACCELERATE_USE_FSDP", "true"), ("ACCELERATE_DYNAMO_BACKEND", "EAGER")])
def test_a_launcher_that_turns_on_a_global_engine_is_refused(tmp_path, monkeypatch, variable, value):
    monkeypatch.setenv(variable, value)
    with pytest.raises(OmniArgumentError, match=rf"^{variable}: "):
        OmniTrainingArguments(output_dir=str(tmp_path), use_cpu=True)


def test_optimizers_that_cannot_be_per_module_are_refused(tmp_path):
    with pytest.raises(OmniArgumentError, match=r"^modules.llm.optim: 'schedule_free_adamw' needs train\(\)"):
        make_args(tmp_path, modules={"llm": {"optim": "schedule_free_adamw"}})
    with pytest.raises(OmniArgumentError, match=r"^optim: 'galore_adamw' builds its own parameter groups"):
        make_args(tmp_path, optim="galore_adamw")


def first_batch(model, n=8):
    data = tiny_data(model, n)
    return {k: torch.stack([data[i][k] for i in range(n)]) for k in ("pixel_values", "input_ids", "labels")}


def test_label_smoothing_smooths_the_targets_the_llm_uses(tmp_path):
    """design.md's Captioner prepends an image prefix with -100 labels and lets the LLM shift: the first step's loss
    equals torch's label-smoothed cross-entropy of the LLM logits against those shifted, extended labels."""
    model = tiny_model()
    reference = copy.deepcopy(model).eval()
    trainer = OmniTrainer(model=model, args=make_args(tmp_path, max_steps=1, label_smoothing_factor=0.1,
                                                      modules=MODULES), train_dataset=tiny_data(model, 8))
    trainer.train()
    batch = first_batch(reference)
    with torch.no_grad():
        prefix = reference.projector(reference.encode_image(batch["pixel_values"]))
        embeds = torch.cat([prefix, reference.llm.get_input_embeddings()(batch["input_ids"])], dim=1)
        logits = reference.llm(inputs_embeds=embeds).logits
    labels = torch.cat([batch["labels"].new_full(prefix.shape[:2], -100), batch["labels"]], dim=1)
    by_hand = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1),
                              ignore_index=-100, label_smoothing=0.1)
    unsmoothed = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1))
    loss = trainer.state.log_history[0]["loss"]
    assert loss == pytest.approx(by_hand.item(), abs=1e-5) and abs(loss - unsmoothed.item()) > 1e-3


class OwnLoss(Captioner):
    """Computes its cross-entropy itself: nothing inside a module could smooth it."""

    def forward(self, input_ids, pixel_values=None, labels=None, **kw):
        logits = super().forward(input_ids=input_ids, pixel_values=pixel_values).logits
        n = input_ids.shape[1]
        loss = F.cross_entropy(logits[:, -n:-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1))
        return {"loss": loss, "logits": logits}


def test_label_smoothing_a_loss_no_module_computes_is_refused(tmp_path):
    base = tiny_model()
    model = OwnLoss.from_modules(base.omni_modules(), processors=base.processors)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    trainer = OmniTrainer(model=model, args=make_args(tmp_path, max_steps=1, label_smoothing_factor=0.1,
                                                      modules=MODULES), train_dataset=tiny_data(model, 8))
    with pytest.raises(OmniArgumentError, match=r"^label_smoothing_factor: the model's loss did not come from"):
        trainer.train()
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # no step was taken


class Noise(TrainerCallback):
    """Registered at train begin, after NEFTune's hook: sees the LLM's embeddings as NEFTune left them."""

    def __init__(self, model):
        self.model, self.seen = model, []

    def on_train_begin(self, *args, **kwargs):
        embed = self.model.llm.get_input_embeddings()
        self.handle = embed.register_forward_hook(
            lambda m, inputs, out: self.seen.append((inputs[0].clone(), out.detach().clone())))

    def on_train_end(self, *args, **kwargs):
        self.handle.remove()


def test_neftune_noise_goes_on_the_llm_token_embeddings(tmp_path):
    """NEFTune adds uniform noise of at most alpha / sqrt(positions x width) to the LLM's token embeddings during
    training; the step's loss is the model's loss on exactly those noisy embeddings."""
    alpha = 5.0
    model = tiny_model()
    reference = copy.deepcopy(model).eval()
    noise = Noise(model)
    trainer = OmniTrainer(model=model, args=make_args(tmp_path, max_steps=1, neftune_noise_alpha=alpha,
                                                      modules=MODULES),
                          train_dataset=tiny_data(model, 8), callbacks=[noise])
    trainer.train()
    (ids, noisy), = noise.seen
    clean = reference.llm.get_input_embeddings()(ids)
    bound = alpha / (ids.shape[1] * clean.shape[-1]) ** 0.5
    difference = (noisy - clean).abs()
    assert 0.5 * bound < difference.max().item() <= bound + 1e-6
    batch = first_batch(reference)
    with torch.no_grad():
        prefix = reference.projector(reference.encode_image(batch["pixel_values"]))
        labels = torch.cat([batch["labels"].new_full(prefix.shape[:2], -100), batch["labels"]], dim=1)
        loss = reference.llm(inputs_embeds=torch.cat([prefix, noisy], dim=1), labels=labels).loss
    assert trainer.state.log_history[0]["loss"] == pytest.approx(loss.item(), abs=1e-5)
    assert not model.llm.get_input_embeddings()._forward_hooks  # removed at the end, as Trainer does


def test_neftune_with_two_token_embeddings_names_the_candidates(tmp_path):
    from real_models import build

    model = build(["bert"])  # BERT's word embeddings and the LLM's
    with pytest.raises(ValueError, match=r"2 modules have token embeddings \['bert', 'llm'\].*input_embeddings_modul"):
        OmniTrainer(model=model, args=make_args(tmp_path, neftune_noise_alpha=5.0))
    type(model).input_embeddings_module = "llm"
    try:
        assert model.get_input_embeddings() is model.llm.get_input_embeddings()
    finally:
        type(model).input_embeddings_module = None


def test_tokens_seen_are_the_input_ids(tmp_path):
    model = tiny_model()
    trainer = OmniTrainer(model=model, args=make_args(tmp_path, max_steps=3, include_num_input_tokens_seen="all",
                                                      modules=MODULES), train_dataset=tiny_data(model, 24))
    trainer.train()
    ids = first_batch(model, 24)["input_ids"]
    assert trainer.state.num_input_tokens_seen == ids.numel()  # 3 steps x 8 rows x 8 ids; the image prefix is not


class Texts(torch.utils.data.Dataset):
    """Captions of 3 to 8 tokens and no image (the grouping reads `input_ids`)."""

    def __init__(self, n=32):
        g = torch.Generator().manual_seed(0)
        self.rows = [torch.randint(4, 19, (int(torch.randint(3, 9, (1,), generator=g)),), generator=g)
                     for _ in range(n)]

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return {"input_ids": self.rows[i], "labels": self.rows[i]}


def pad(rows):
    n = max(len(r["input_ids"]) for r in rows)
    ids = torch.stack([F.pad(r["input_ids"], (0, n - len(r["input_ids"]))) for r in rows])
    labels = torch.stack([F.pad(r["labels"], (0, n - len(r["labels"])), value=-100) for r in rows])
    return {"input_ids": ids, "labels": labels}


class TextOnly(Captioner):
    def forward(self, input_ids, labels=None, **kw):
        return self.llm(input_ids=input_ids, labels=labels, **kw)


def test_group_by_length_serves_each_mega_batch_longest_first(tmp_path):
    """LengthGroupedSampler's rule, by hand: 32 rows at batch 4 make mega-batches of min(32 // 16, 50) x 4 = 8 rows,
    each served longest first, the longest row of all at the very start; every row once."""
    base = tiny_model()
    model = TextOnly.from_modules(base.omni_modules(), processors=base.processors)
    data, seen = Texts(), []
    model.register_forward_pre_hook(lambda m, a, kw: seen.extend((kw["labels"] != -100).sum(1).tolist()),
                                    with_kwargs=True)
    trainer = OmniTrainer(model=model, args=make_args(tmp_path, max_steps=8, per_device_train_batch_size=4,
                                                      train_sampling_strategy="group_by_length",
                                                      modules={"vision": {"trainable": False}}),
                          train_dataset=data, data_collator=pad)
    trainer.train()
    assert sorted(seen) == sorted(len(r) for r in data.rows) and seen[0] == max(seen)
    for start in range(0, len(seen), 8):
        assert seen[start:start + 8] == sorted(seen[start:start + 8], reverse=True), seen
    assert seen != sorted(seen, reverse=True)  # grouped, not sorted as a whole


def test_use_cache_and_checkpointing_every_n_layers_reach_the_modules(tmp_path):
    from hf_omni.testing.digits import build_model

    model = build_model(hidden=32, layers=1, llm_hidden=32, llm_layers=2)
    args = make_args(tmp_path, max_steps=1, modules={"vision": {"trainable": False}, "llm": {
        "activation_checkpointing": True, "activation_checkpointing_kwargs": {"every_n_layers": 2}}})
    model.llm.config.use_cache = True
    trainer = OmniTrainer(model=model, args=args, train_dataset=tiny_data(model, 8))
    assert model.llm.config.use_cache is False  # TrainingArguments' use_cache, as Trainer sets it on its model
    trainer.train()
    layers = model.llm.model.layers
    assert len(layers) == 2 and [layer.gradient_checkpointing for layer in layers] == [True, False]
