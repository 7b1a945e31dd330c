"""The modules users bring (tests/real_models.py): Llama, Mixtral (MoE: transformers 5 merges its experts on
load), ViT with an unused pooler, ResNet (BatchNorm buffers), BERT, CLIP and SigLIP towers; trained full, frozen,
with LoRA, DoRA, rsLoRA, LoRA on embeddings and modules_to_save; from modules built in memory (one frozen in
bf16 beside fp32 ones), from fp32 / bf16 folders, eagerly and with empty_init. Each case: a resumed run ends
bitwise equal to the uninterrupted one (every parameter and buffer); every module's export, plain and merged,
reloads with its Auto class and gives the live module's outputs."""

import json
import os

import pytest
import torch
from real_model_runs import MATRIX, mismatches, straight_and_resumed
from real_models import Batches, MultiEncoder, encode
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM
from transformers.models.auto.modeling_auto import MODEL_MAPPING

from hf_omni.formats.transformers_classes import resolve_module_class


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return str(tmp_path_factory.mktemp("real_models"))


def module_outputs(module, name: str, batch: dict) -> torch.Tensor:
    with torch.no_grad():
        if name == "llm":
            return module(input_ids=batch["input_ids"]).logits.float()
        if name == "projector":
            return module(torch.ones(2, 3, 16, dtype=module.dtype)).float()
        out = encode(name, module, batch["pixel_values"], batch["text_ids"])
        return getattr(out, "last_hidden_state", out).float()


def loader_for(name: str, folder: str):
    """The class a module's export loads with: its Auto class where that builds the module's class, else the class
    itself, as the root config records it (T5's encoder alone: AutoModel builds the whole T5Model; Whisper's
    encoder and Qwen2-VL's tower: classes transformers does not export at its top level)."""
    if name == "llm":
        return AutoModelForCausalLM
    root = json.load(open(os.path.join(os.path.dirname(folder), "config.json")))
    record = {m["name"]: m["class"] for m in root["modules"]}[name]
    cls = resolve_module_class(record, name)
    auto = MODEL_MAPPING.get(type(AutoConfig.from_pretrained(folder)), None)
    return AutoModel if auto is cls else cls


def tied_groups(module) -> list[set[str]]:
    names: dict[int, set[str]] = {}
    for n, p in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), set()).add(n)
    return sorted((g for g in names.values() if len(g) > 1), key=sorted)


@pytest.mark.parametrize("case", list(MATRIX))
def test_resume_is_bitwise_and_exports_reload(root, case):
    straight, final, resumed = straight_and_resumed(root, case)
    assert mismatches(final, resumed) == []
    model = straight.model.eval()
    modes = MATRIX[case][3]
    if modes.get("resnet") == "full":  # BatchNorm statistics trained, and restored on resume (checked above)
        assert final["resnet.embedder.embedder.normalization.num_batches_tracked"].item() == 4
    batch = {k: torch.stack([Batches()[i][k] for i in range(4)]) for k in ("pixel_values", "text_ids", "input_ids")}
    ties = {name: tied_groups(getattr(model, name)) for name in modes}
    if MATRIX[case][0] in ("gemma", "llama_tied"):  # tied weights stay one parameter through training and resume
        assert [sorted(g) for g in ties["llm"]] == [["lm_head.weight", "model.embed_tokens.weight"]] or \
            modes["llm"] == "lora_emb"
        assert ties["t5"], ties
    all_fp32 = all(p.dtype == torch.float32 for p in model.parameters())  # else merges round to bf16
    for merge in (False, True):
        out = os.path.join(root, case, f"export_merged_{merge}")
        straight.args.merge_lora_on_export = merge
        straight.save_model(out)
        for name, mode in modes.items():
            folder = os.path.join(out, name)
            assert os.path.exists(os.path.join(folder, "adapter_config.json")) == (not merge and mode not in
                                                                                  ("full", "frozen"))
            loaded = loader_for(name, folder).from_pretrained(folder).eval()
            if mode != "lora_emb":  # the export keeps its ties (merged ones too) ...
                assert len(tied_groups(loaded)) == len(ties[name]), (case, name)
            elif ties[name] and merge:  # ... but LoRA trained one side of a tied embedding: merged, they are apart
                assert tied_groups(loaded) == []
            tol = 1e-5 if not merge or next(loaded.parameters()).dtype == torch.float32 else 5e-2
            live, got = module_outputs(getattr(model, name), name, batch), module_outputs(loaded, name, batch)
            assert (live - got).abs().max().item() <= tol * max(1.0, live.abs().max().item()), (case, name, mode)
        again = MultiEncoder.from_pretrained(out).eval()
        with torch.no_grad():
            diff = (again(**batch).logits.float() - model(**batch).logits.float()).abs().max().item()
        assert diff <= (1e-5 if not merge or all_fp32 else 0.1), (case, merge, diff)


def test_never_stepped_parameters_resume_without_optimizer_state(root):
    """ViT's pooler trains (requires grad) but the forward never uses it: no optimizer state is saved for it and
    none is restored — as in the uninterrupted run."""
    straight, _, _ = straight_and_resumed(root, "llama_fp32")
    state = straight.plugin.optimizer.optimizers["vit"].state
    pooler = straight.model.vit.pooler.dense.weight
    assert pooler.requires_grad and pooler not in state and len(state) > 0


def test_a_tensor_the_checkpoint_cannot_restore_is_refused_before_loading(root, monkeypatch):
    """Mixtral's experts live in the checkpoint's state/ (the HF files hold them split): a state/ without them is
    refused, naming module and tensor, before any module is touched."""
    from real_model_runs import case_trainer

    from hf_omni.checkpoint import module_state

    ckpt = os.path.join(root, "mixtral_fp32", "straight", "checkpoint-2")
    if not os.path.isdir(ckpt):
        case_trainer(root, "mixtral_fp32", os.path.join(root, "mixtral_fp32", "straight")).train()
    keys = module_state.state_keys
    monkeypatch.setattr(module_state, "state_keys",
                        lambda folder, metadata=None: [k for k in keys(folder, metadata)
                                                       if not k.startswith("tensors.")])
    trainer = case_trainer(root, "mixtral_fp32", os.path.join(root, "refused"), seed=3)
    before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    with pytest.raises(ValueError, match=r"module 'llm': .*state lacks 2 tensors \['model\.layers\.0\.mlp\.experts"):
        trainer.train(resume_from_checkpoint=ckpt)
    after = trainer.model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before if k.split(".")[0] in ("projector", "llm", "bert"))
