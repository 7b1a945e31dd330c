"""OmniModel: composition, save_pretrained / from_pretrained, each module folder loading alone, loss counting."""

import json
import os

import pytest
import torch
from helpers import Captioner, make_args, step_losses, tiny_data, tiny_model
from peft import LoraConfig, PeftModel, inject_adapter_in_model
from transformers import AutoModel, AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

from hf_omni import OmniConfig, OmniModel, OmniTrainer, Projector, ProjectorConfig


def _inputs(model, n=4):
    data = tiny_data(model, n)
    return {k: torch.stack([data[i][k] for i in range(n)]) for k in ("pixel_values", "input_ids", "labels")}


def test_save_load_roundtrip_and_each_module_alone(tmp_path):
    model = tiny_model().eval()
    torch.manual_seed(3)
    inject_adapter_in_model(LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False), model.llm)
    batch = _inputs(model)
    expected = model(**batch)
    model.save_pretrained(tmp_path)

    root = json.loads((tmp_path / "config.json").read_text())
    assert root["model_type"] == "hf_omni"
    assert [m["name"] for m in root["modules"]] == ["vision", "projector", "llm"]
    assert {m["name"]: m["class"] for m in root["modules"]} == {
        "vision": "ViTModel", "projector": "Projector", "llm": "LlamaForCausalLM"}

    loaded = Captioner.from_pretrained(tmp_path).eval()
    assert type(loaded) is Captioner and isinstance(loaded.config, OmniConfig)
    got = loaded(**batch)
    assert torch.equal(got.logits, expected.logits) and torch.equal(got.loss, expected.loss)

    # every module folder loads alone with the Auto class that fits it
    vision = AutoModel.from_pretrained(tmp_path / "vision").eval()
    pixels = batch["pixel_values"]
    assert torch.equal(vision(pixel_values=pixels).last_hidden_state,
                       model.vision(pixel_values=pixels).last_hidden_state)
    projector = AutoModel.from_pretrained(tmp_path / "projector")
    assert isinstance(projector, Projector)
    feats = torch.randn(2, 5, 32)
    assert torch.equal(projector(feats), model.projector(feats))
    embeds = torch.randn(2, 6, 32)
    llm = AutoModelForCausalLM.from_pretrained(tmp_path / "llm").eval()  # base weights + adapter beside them
    assert torch.allclose(llm(inputs_embeds=embeds).logits, model.llm(inputs_embeds=embeds).logits, atol=1e-6)
    plain = tmp_path / "base_only"  # the base weights alone, then PEFT's own loader adds the adapter
    plain.mkdir()
    for name in ("config.json", "model.safetensors"):
        (plain / name).write_bytes((tmp_path / "llm" / name).read_bytes())
    base = LlamaForCausalLM.from_pretrained(plain)
    assert not hasattr(base, "peft_config")
    peft_model = PeftModel.from_pretrained(base, tmp_path / "llm").eval()
    assert torch.allclose(peft_model(inputs_embeds=embeds).logits, model.llm(inputs_embeds=embeds).logits, atol=1e-6)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "llm")
    assert tokenizer.convert_tokens_to_ids("seven") == model.processors["llm"].convert_tokens_to_ids("seven")
    assert "llm" in loaded.processors


def test_merged_lora_export_is_a_plain_model(tmp_path):
    model = tiny_model().eval()
    inject_adapter_in_model(LoraConfig(r=4, target_modules=["q_proj"], init_lora_weights=False), model.llm)
    model.save_pretrained(tmp_path, merge_lora=True)
    assert not os.path.exists(tmp_path / "llm" / "adapter_config.json")
    llm = AutoModelForCausalLM.from_pretrained(tmp_path / "llm").eval()
    embeds = torch.randn(2, 6, 32)
    assert torch.allclose(llm(inputs_embeds=embeds).logits, model.llm(inputs_embeds=embeds).logits, atol=1e-5)


def test_source_recorded_for_module_loaded_from_folder(tmp_path):
    encoder = Projector(ProjectorConfig(in_features=4, out_features=4))
    encoder.save_pretrained(tmp_path / "released")
    released = Projector.from_pretrained(tmp_path / "released")

    class Two(OmniModel):
        def forward(self, x):
            return self.head(self.encoder(x))

    model = Two.from_modules({"encoder": released, "head": Projector(ProjectorConfig(in_features=4, out_features=2))})
    assert model.config.module_entry("encoder").source == str(tmp_path / "released")
    assert model.config.module_entry("head").source is None
    model.save_pretrained(tmp_path / "out")
    import shutil

    shutil.rmtree(tmp_path / "out" / "encoder")  # reloads from its recorded source
    again = Two.from_pretrained(tmp_path / "out")
    x = torch.randn(3, 4)
    assert torch.equal(again(x), model(x))


def test_bad_composition_errors():
    with pytest.raises(ValueError, match="module 'x'.*PreTrainedModel"):
        OmniModel.from_modules({"x": torch.nn.Linear(2, 2)})
    with pytest.raises(ValueError, match="module 'train'.*clashes"):
        OmniModel.from_modules({"train": Projector(ProjectorConfig(in_features=2, out_features=2))})
    with pytest.raises(ValueError, match="module 'tok'"):
        OmniModel.from_modules({"p": Projector(ProjectorConfig(2, 2))}, processors={"tok": object()})


class ShiftedTextLM(OmniModel):
    """Hands its labels straight to a causal LM: every label after the first is a target."""

    label_shift = True

    def forward(self, input_ids, labels=None, **kw):
        return self.llm(input_ids=input_ids, labels=labels, **kw)


class DropsKwargs(Captioner):
    """Accepts **kw (so Trainer passes num_items_in_batch) but never hands it on: the documented pitfall."""

    def forward(self, pixel_values, input_ids, labels=None, **kw):
        return super().forward(input_ids, pixel_values=pixel_values, labels=labels)


class _Text(torch.utils.data.Dataset):
    def __init__(self, n=32, length=7, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(4, 19, (n, length), generator=g)
        self.labels = self.ids.clone()
        for i in range(n):  # ragged targets so that the count matters
            self.labels[i, length - 1 - (i % 4):] = -100

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.labels[i]}


@pytest.mark.parametrize("accumulation", [1, 2])
def test_label_shift_counts_shifted_labels(tmp_path, accumulation):
    torch.manual_seed(0)
    llm = tiny_model().llm
    model = ShiftedTextLM.from_modules({"llm": llm})
    assert model.loss_type == "ForCausalLM"
    data = _Text()
    reference = ShiftedTextLM.from_modules({"llm": __import__("copy").deepcopy(llm)})
    args = make_args(tmp_path, per_device_train_batch_size=8 // accumulation, gradient_accumulation_steps=accumulation,
                     max_steps=2, learning_rate=1e-3)
    trainer = OmniTrainer(model=model, args=args, train_dataset=data)
    trainer.train()
    # the first logged loss is the exact token mean over the whole 8-sample batch
    batch = {k: torch.stack([data[i][k] for i in range(8)]) for k in ("input_ids", "labels")}
    assert step_losses(trainer)[0] == pytest.approx(reference(**batch).loss.item(), abs=1e-6)


def test_default_counts_every_label(tmp_path):
    model = tiny_model()
    assert model.loss_type is None  # every label that is not -100 counts (the prefix is -100, the LM shifts)


def test_forward_dropping_kwargs_scales_loss_by_accumulation(tmp_path):
    """Documented pitfall: a forward that swallows **kw gets a loss scaled by accumulation steps (x world size)."""
    torch.manual_seed(0)
    base = tiny_model()
    model = DropsKwargs(base.config, modules=base.omni_modules(), processors=base.processors)
    data = tiny_data(model)
    batch = {k: torch.stack([data[i][k] for i in range(4)]) for k in ("pixel_values", "input_ids", "labels")}
    mean_loss = model(**batch).loss.item()
    args = make_args(tmp_path, per_device_train_batch_size=2, gradient_accumulation_steps=2, max_steps=1,
                     learning_rate=0.0)
    trainer = OmniTrainer(model=model, args=args, train_dataset=data)
    trainer.train()
    assert step_losses(trainer)[0] == pytest.approx(2 * mean_loss, rel=1e-3)


def test_empty_init_fills_the_saved_weights(tmp_path, caplog):
    """empty_init + prepare (no process group: every module filled whole) gives exactly the saved weights,
    including a ViT saved under transformers' legacy key names and a LoRA adapter beside the LLM's weights."""
    from accelerate import Accelerator

    from hf_omni import OmniPlugin

    model = tiny_model()
    inject_adapter_in_model(LoraConfig(r=4, target_modules=["q_proj"], init_lora_weights=False), model.llm)
    model.save_pretrained(tmp_path)
    eager = Captioner.from_pretrained(tmp_path)
    empty = Captioner.from_pretrained(tmp_path, empty_init=True)
    assert all(p.is_meta for p in empty.parameters())
    plugin = OmniPlugin(modules={"vision": {"trainable": False}}, output_dir=str(tmp_path / "run"))
    with caplog.at_level("WARNING", logger="hf_omni.files.weights"):
        plugin.prepare(Accelerator(cpu=True), empty, num_training_steps=1)
    assert "pooler" in caplog.text  # the one parameter the files lack (ViT's config forgets add_pooling_layer)
    state = {k: v for k, v in eager.state_dict().items() if ".pooler." not in k}
    for key, value in state.items():
        assert torch.equal(value, empty.state_dict()[key]), key


LORA_KINDS = {  # LoraConfig -> merged row by row (True) or by PEFT on a gathered copy
    "lora": (dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]), True),
    "rslora": (dict(r=4, lora_alpha=8, target_modules=["q_proj"], use_rslora=True), True),
    "dora": (dict(r=4, target_modules=["q_proj", "o_proj"], use_dora=True), True),
    "lora_bias": (dict(r=4, target_modules=["q_proj"], lora_bias=True), True),
    "modules_to_save": (dict(r=4, target_modules=["q_proj"], modules_to_save=["lm_head"]), True),
    "embedding": (dict(r=4, target_modules=["embed_tokens", "q_proj"]), True),
    "dora_on_embedding": (dict(r=4, target_modules=["embed_tokens"], use_dora=True), False),
}


def test_a_merge_by_peft_is_refused_above_the_limit_for_whole_copies(tmp_path, monkeypatch):
    """DoRA on an embedding needs PEFT's own merge, on the gathered module beside its merged copy on the main
    process: allowed up to `whole.WHOLE_COPY_LIMIT` bytes of module, refused above it before anything is gathered
    or written, naming the module, its size and what to use instead."""
    from hf_omni.files import whole

    model = tiny_model().eval()
    inject_adapter_in_model(LoraConfig(**LORA_KINDS["dora_on_embedding"][0], init_lora_weights=False), model.llm)
    size = whole.module_bytes(model.llm)
    monkeypatch.setattr(whole, "WHOLE_COPY_LIMIT", size - 1)
    with pytest.raises(ValueError) as refused:
        model.save_pretrained(tmp_path / "refused", merge_lora=True)
    message = str(refused.value)
    assert "module 'llm'" in message and f"({size / 2**30:.2f} GiB)" in message and "WHOLE_COPY_LIMIT" in message
    assert "merge_lora" in message and "merge_and_unload" in message
    assert not (tmp_path / "refused" / "llm" / "model.safetensors").exists()
    monkeypatch.setattr(whole, "WHOLE_COPY_LIMIT", size)
    model.save_pretrained(tmp_path / "merged", merge_lora=True)
    assert (tmp_path / "merged" / "llm" / "model.safetensors").exists()


def test_merge_lora_on_export_that_needs_peft_above_the_limit_is_refused_at_prepare(tmp_path, monkeypatch):
    """With `merge_lora_on_export: true` the same refusal comes when the modules are prepared (LoRA injected, before
    any step), not at the first export after training; without it the run prepares."""
    from accelerate import Accelerator

    from hf_omni import OmniPlugin
    from hf_omni.files import whole

    monkeypatch.setattr(whole, "WHOLE_COPY_LIMIT", 1000)
    lora = {"r": 4, "target_modules": ["embed_tokens"], "use_dora": True}
    for merge in (True, False):
        plugin = OmniPlugin(modules={"llm": {"lora": lora}}, output_dir=str(tmp_path),
                            defaults={"merge_lora_on_export": merge})
        if merge:
            with pytest.raises(ValueError, match="module 'llm': merging LoRA with PEFT's own merge"):
                plugin.prepare_modules(Accelerator(cpu=True), tiny_model())
        else:
            plugin.prepare_modules(Accelerator(cpu=True), tiny_model())


@pytest.mark.parametrize("kind", list(LORA_KINDS))
def test_lora_merge_for_export_is_row_by_row_and_equals_peft(tmp_path, monkeypatch, kind):
    """Plain LoRA, rsLoRA, DoRA, a LoRA bias, `modules_to_save` and LoRA on an embedding are merged row by row where
    the rows are written (no gathered copy, no PEFT merge): the files equal PEFT's own `merge_and_unload` within
    float rounding. DoRA on an embedding goes through PEFT on a gathered copy."""
    from safetensors.torch import load_file

    import hf_omni.files.folder as folder_io
    from hf_omni.files.peft_merge import merged_module
    from hf_omni.lora.adapters import base_state_dict

    config, by_rows = LORA_KINDS[kind]
    model = tiny_model().eval()
    if kind == "lora_bias":  # a bias to merge into (Llama with attention_bias)
        model.llm.config.attention_bias = True
        for layer in model.llm.model.layers:
            for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
                linear = getattr(layer.self_attn, proj)
                linear.bias = torch.nn.Parameter(torch.randn(linear.out_features))
    inject_adapter_in_model(LoraConfig(**config, init_lora_weights=False), model.llm)
    if kind == "modules_to_save":  # the trained copy differs from the original
        with torch.no_grad():
            model.llm.lm_head.modules_to_save["default"].weight.add_(0.5)
    expected = merged_module(model.llm, dict(model.llm.state_dict())).state_dict()
    peft_merges = []
    original = folder_io.save_merged
    monkeypatch.setattr(folder_io, "save_merged", lambda *a, **k: peft_merges.append(1) or original(*a, **k))
    model.save_pretrained(tmp_path / "rows", merge_lora=True)
    assert peft_merges == ([] if by_rows else [1])
    written = load_file(str(tmp_path / "rows" / "llm" / "model.safetensors"))
    assert written.keys() == expected.keys()
    for key, value in written.items():
        assert torch.allclose(value, expected[key], atol=1e-6, rtol=0), key
    changed = {"modules_to_save": "lm_head.weight", "dora_on_embedding": "model.embed_tokens.weight"}.get(
        kind, "model.layers.0.self_attn.q_proj.weight")
    assert not torch.equal(written[changed], base_state_dict(dict(model.llm.state_dict()))[changed])
