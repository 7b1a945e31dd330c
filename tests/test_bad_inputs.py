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


def crafted(tmp_path, saved, **changes) -> str:
    """A copy of the saved model whose root config.json has the llm entry changed."""
    import shutil

    folder = tmp_path / "crafted"
    shutil.copytree(saved, folder)
    config = json.loads((folder / "config.json").read_text())
    entry = next(m for m in config["modules"] if m["name"] == "llm")
    entry.update(changes)
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "hf_omni_checkpoint.json").write_text(json.dumps({"files": {}, "modules": ["llm"]}))  # looks complete
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

    folder = crafted(tmp_path, saved)
    outside = tmp_path / "outside"
    shutil.move(os.path.join(folder, "llm"), outside)
    os.symlink(outside, os.path.join(folder, "llm"))
    with pytest.raises(ValueError, match=r"module 'llm': .*llm leads outside"):
        Captioner.from_pretrained(folder)


def test_a_source_that_is_not_a_module_folder_is_refused(tmp_path, saved):
    import shutil

    stray = tmp_path / "not_a_module"
    stray.mkdir()
    (stray / "secret.txt").write_text("x")
    folder = crafted(tmp_path, saved, source=str(stray))
    shutil.rmtree(os.path.join(folder, "llm"))  # so the source is what would be read
    with pytest.raises(ValueError, match=r"module 'llm': source .*not_a_module is not a module folder"):
        Captioner.from_pretrained(folder)
    with pytest.raises(ValueError, match=r"not a module folder"):
        export(folder, str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()


def test_export_copies_module_files_only(tmp_path, saved):
    """A source (or subfolder) is read as an HF module folder: stray files and links are never copied."""
    import shutil

    folder = crafted(tmp_path, saved)
    (tmp_path / "crafted" / "llm" / "stray.txt").write_text("not a module file")
    os.symlink("/etc/hostname", tmp_path / "crafted" / "llm" / "tokenizer_link.json")
    export(folder, str(tmp_path / "out"))
    copied = sorted(os.listdir(tmp_path / "out" / "llm"))
    assert "stray.txt" not in copied and "tokenizer_link.json" not in copied
    assert "config.json" in copied and "model.safetensors" in copied and "tokenizer.json" in copied
    shutil.rmtree(tmp_path / "out")
