"""Hostile or broken inputs: each gets one clear error before anything is computed, and nothing on disk changes.
(Paths in a checkpoint's or export's root config.json first; the faults issue grows this catalogue.)"""

import json
import os

import pytest
from helpers import Captioner, tiny_model

from hf_omni.cli import export


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("saved")
    tiny_model().save_pretrained(root / "model")
    return root / "model"


def crafted(tmp_path, saved, prepare=None, **changes) -> str:
    """A copy of the saved model whose root config.json has the llm entry changed (after `prepare(folder)`), with a
    marker listing every file: it looks like a complete checkpoint."""
    import shutil

    from hf_omni.checkpoint_files import marker_info, write_marker

    folder = tmp_path / "crafted"
    shutil.copytree(saved, folder)
    if prepare is not None:
        prepare(folder)
    config = json.loads((folder / "config.json").read_text())
    entry = next(m for m in config["modules"] if m["name"] == "llm")
    entry.update(changes)
    (folder / "config.json").write_text(json.dumps(config))
    write_marker(str(folder), marker_info(str(folder), 0, ["llm"]))
    return str(folder)


def snapshot(root) -> dict:
    return {os.path.join(d, f): os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(root) for f in fs}


@pytest.mark.parametrize("changes,message", [
    (dict(subfolder="../../escaped"), r"module 'llm': subfolder '\.\./\.\./escaped' must be a plain folder name"),
    (dict(subfolder="/etc"), r"module 'llm': subfolder '/etc' must be a plain folder name"),
    (dict(subfolder=".."), r"subfolder '\.\.' must be a plain folder name"),
    (dict(subfolder="a/b"), r"subfolder 'a/b' must be a plain folder name"),
    (dict(source="relative/dir"), r"source 'relative/dir' must be an absolute path"),
])
def test_crafted_paths_are_refused_on_load_and_export(tmp_path, saved, changes, message):
    folder = crafted(tmp_path, saved, **changes)
    before = snapshot(tmp_path)
    with pytest.raises(ValueError, match=message):
        Captioner.from_pretrained(folder)
    with pytest.raises(ValueError, match=message):
        export(folder, str(tmp_path / "out"))
    assert snapshot(tmp_path) == before  # nothing written, nothing removed


def test_a_symlinked_subfolder_leaving_the_folder_is_refused(tmp_path, saved):
    import shutil

    def link_outside(folder):
        shutil.move(folder / "llm", tmp_path / "outside")
        os.symlink(tmp_path / "outside", folder / "llm")

    folder = crafted(tmp_path, saved, prepare=link_outside)
    with pytest.raises(ValueError, match=r"module 'llm': .*llm leads outside"):
        Captioner.from_pretrained(folder)


def test_a_source_that_is_not_a_module_folder_is_refused(tmp_path, saved):
    import shutil

    stray = tmp_path / "not_a_module"
    stray.mkdir()
    (stray / "secret.txt").write_text("x")
    folder = crafted(tmp_path, saved, prepare=lambda f: shutil.rmtree(f / "llm"), source=str(stray))  # source read
    with pytest.raises(ValueError, match=r"module 'llm': source .*not_a_module is not a module folder"):
        Captioner.from_pretrained(folder)
    with pytest.raises(ValueError, match=r"not a module folder"):
        export(folder, str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()


def test_export_copies_module_files_only(tmp_path, saved):
    """A source (or subfolder) is read as an HF module folder: stray files and links are never copied."""
    import shutil

    def strays(folder):
        (folder / "llm" / "stray.txt").write_text("not a module file")
        os.symlink("/etc/hostname", folder / "llm" / "tokenizer_link.json")

    folder = crafted(tmp_path, saved, prepare=strays)
    export(folder, str(tmp_path / "out"))
    copied = sorted(os.listdir(tmp_path / "out" / "llm"))
    assert "stray.txt" not in copied and "tokenizer_link.json" not in copied
    assert "config.json" in copied and "model.safetensors" in copied and "tokenizer.json" in copied
    shutil.rmtree(tmp_path / "out")


# -- checkpoint folders -------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from checkpoint_scenario import make_trainer

    root = tmp_path_factory.mktemp("ckpt")
    make_trainer(root, max_steps=5, save_steps=5).train()
    return root / "checkpoint-5"


def resume(tmp_path, folder):
    from checkpoint_scenario import make_trainer

    return make_trainer(tmp_path / "run", max_steps=10).train(resume_from_checkpoint=str(folder))


def spoiled(tmp_path, checkpoint, spoil):
    import shutil

    folder = tmp_path / "checkpoint-5"
    shutil.copytree(checkpoint, folder)
    spoil(folder)
    return folder


def _marker(folder, change):
    data = json.loads((folder / "hf_omni_checkpoint.json").read_text())
    change(data)
    (folder / "hf_omni_checkpoint.json").write_text(json.dumps(data))


CHECKPOINT_CASES = {
    "missing": (lambda f: __import__("shutil").rmtree(f), "does not exist"),
    "no marker": (lambda f: os.remove(f / "hf_omni_checkpoint.json"), "no hf_omni_checkpoint.json: it is incomplete"),
    "malformed marker": (lambda f: (f / "hf_omni_checkpoint.json").write_text("{not json"), "is not valid JSON"),
    "marker without files": (lambda f: _marker(f, lambda d: d.pop("files")), "has no file list"),
    "truncated weights": (lambda f: (f / "llm" / "model.safetensors").write_bytes(b"x" * 10),
                          r"llm/model\.safetensors has 10 bytes"),
    "missing scheduler": (lambda f: os.remove(f / "llm" / "state" / "scheduler.pt"), r"file llm/state/scheduler\.pt is missing"),
    "unlisted file": (lambda f: (f / "llm" / "extra.bin").write_bytes(b"x"), r"file llm/extra\.bin is not listed"),
    "marker path outside": (lambda f: _marker(f, lambda d: d["files"].update({"../escape": 1})),
                            "lists a path outside it"),
    "another module set": (lambda f: _marker(f, lambda d: d.update(modules=["llm"])),
                           r"holds trainable modules \['llm'\].*missing: \['projector'\]"),
}


@pytest.mark.parametrize("case", list(CHECKPOINT_CASES))
def test_bad_checkpoint_folders_are_refused_before_anything(tmp_path, checkpoint, case):
    spoil, message = CHECKPOINT_CASES[case]
    folder = spoiled(tmp_path, checkpoint, spoil)
    before = snapshot(tmp_path)
    with pytest.raises((ValueError, FileNotFoundError), match=message):
        resume(tmp_path, folder)
    after = {k: v for k, v in snapshot(tmp_path).items() if "/run/" not in k}
    assert after == {k: v for k, v in before.items() if "/run/" not in k}  # the checkpoint is left as it was
