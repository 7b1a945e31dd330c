"""A frozen encoder released on the Hub stays linked through a round trip in one HF cache: a run pushes per module
(the encoder linked), the composition is loaded back by repo id, its modules composed again, and a second run's
`single` push (token given as `hub_token`) links the encoder at its commit again; changed by hand, it is uploaded."""

import json
import os

import huggingface_hub
import pytest
import torch
import transformers.utils.hub
from helpers import make_args, tiny_data, tiny_model

from hf_omni import OmniModel, OmniTrainer
from hf_omni.testing import LoopbackHub
from hf_omni.testing.digits import Captioner

TOKEN = "hf_SECRETtoken0123456789abcdef"
MODULES = {"vision": {"trainable": False}, "projector": {"learning_rate": 3e-3},
           "llm": {"lora": {"r": 4, "target_modules": ["q_proj", "v_proj"]}}}


@pytest.fixture
def hub(tmp_path):
    with LoopbackHub() as server, pytest.MonkeyPatch.context() as mp:
        for name, value in server.client_constants(str(tmp_path / "hf_cache")).items():
            mp.setattr(huggingface_hub.constants, name, value)
        mp.delenv("HF_TOKEN", raising=False)
        mp.setattr(transformers.utils.hub, "_hf_api", None)  # Trainer's shared HfApi keeps the endpoint it was made at
        yield server


def run_and_push(model, out, repo, **hub_args):
    args = make_args(out, max_steps=1, modules=MODULES, push_to_hub=True, hub_model_id=repo, hub_strategy="end",
                     hub_token=TOKEN, **hub_args)
    trainer = OmniTrainer(model=model, args=args, train_dataset=tiny_data(model, 8))
    trainer.train()
    trainer.push_to_hub()
    return trainer


def vision_entry(hub, repo) -> dict:
    return {e["name"]: e for e in json.loads(hub.files(repo)["config.json"])["modules"]}["vision"]


def test_an_encoder_loaded_back_from_a_composition_repo_is_linked_again_not_uploaded(hub, tmp_path):
    from transformers import ViTModel

    base = tiny_model()
    ViTModel(base.vision.config).save_pretrained(tmp_path / "eye")  # with its pooler: a load reads every tensor
    huggingface_hub.HfApi().create_repo("org/eye")
    huggingface_hub.HfApi().upload_folder(repo_id="org/eye", folder_path=str(tmp_path / "eye"))
    eye_head, eye_commits = hub.repos["org/eye"]["branches"]["main"], len(hub.commits("org/eye"))
    eye = ViTModel.from_pretrained("org/eye")
    model = Captioner.from_modules({"vision": eye, "projector": base.projector,
                                    "llm": base.llm}, processors=base.processors)
    run_and_push(model, tmp_path / "one", "org/name")
    assert "org/name-vision" not in hub.repos and vision_entry(hub, "org/name")["hub_repo"] == "org/eye"

    loaded = OmniModel.from_pretrained("org/name")  # the encoder now read from the cache's snapshot of org/eye
    again = Captioner.from_modules(loaded.omni_modules(), processors=loaded.processors)
    trainer = run_and_push(again, tmp_path / "two", "org/two", hub_layout="single")
    files = hub.files("org/two")
    assert not [p for p in files if p.startswith("vision/")] and {"projector/model.safetensors",
                                                                  "llm/adapter_model.safetensors"} <= set(files)
    entry = vision_entry(hub, "org/two")
    assert (entry["hub_repo"], entry["hub_revision"], entry["trained"]) == ("org/eye", eye_head, False)
    assert len(hub.commits("org/eye")) == eye_commits and "org/two-vision" not in hub.repos
    assert any(p.endswith("/org/two/commit/main") and h.get("authorization") == f"Bearer {TOKEN}"
               for m, p, h in hub.requests if m == "POST")
    back = Captioner.from_pretrained("org/two")
    torch.testing.assert_close(back.vision.state_dict(), eye.state_dict(), atol=0, rtol=0)

    with torch.no_grad():  # frozen all the same, but no longer what org/eye holds: uploaded
        again.vision.embeddings.cls_token.add_(1.0)
    trainer.push_to_hub()
    files = hub.files("org/two")
    assert "vision/model.safetensors" in files and vision_entry(hub, "org/two")["hub_repo"] is None
    torch.testing.assert_close(Captioner.from_pretrained("org/two").vision.embeddings.cls_token,
                               again.vision.embeddings.cls_token, atol=0, rtol=0)


def test_an_encoder_downloaded_with_only_the_files_a_module_needs_is_linked(hub, tmp_path):
    """The repo holds more than a module folder (a notes file, a second weights format); hf_omni's own download
    (`allow_patterns`) caches only the module's files, so the cache holds the repo's file list but not every file.
    The link check finds the snapshot anyway and compares the files it needs: linked, not uploaded."""
    from transformers import ViTModel

    from hf_omni.hub.download import download_module

    base = tiny_model()
    ViTModel(base.vision.config).save_pretrained(tmp_path / "eye")
    (tmp_path / "eye" / "notes.txt").write_text("not a module file\n")
    huggingface_hub.HfApi().create_repo("org/eye")
    huggingface_hub.HfApi().upload_folder(repo_id="org/eye", folder_path=str(tmp_path / "eye"))
    eye_head = hub.repos["org/eye"]["branches"]["main"]
    folder = download_module("org/eye", None, "vision")  # hf_omni's download: module files only
    assert "notes.txt" not in os.listdir(folder)
    model = Captioner.from_modules({"vision": ViTModel.from_pretrained(folder), "projector": base.projector,
                                    "llm": base.llm}, processors=base.processors)
    assert model.config.module_entry("vision").hub_repo == "org/eye"
    run_and_push(model, tmp_path / "run", "org/name")
    entry = vision_entry(hub, "org/name")
    assert "org/name-vision" not in hub.repos and (entry["hub_repo"], entry["hub_revision"]) == ("org/eye", eye_head)
