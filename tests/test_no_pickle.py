"""No load path unpickles, so a checkpoint or export from a stranger cannot run code: every load below runs inside
`no_unpickling()` (each way Python or torch unpickles raises), on a checkpoint that carries planted pickles —
Trainer's own `optimizer.pt`, `scheduler.pt`, `scaler.pt`, `rng_state.pth`, `training_args.bin`, DCP's `.metadata`,
all listed in its marker, each of which would create a file if unpickled."""

import json
import pickle
import shutil

import pytest
import torch
from checkpoint_scenario import resume_trainer
from helpers import Captioner, full_state
from no_pickle import Unpickled, no_unpickling
from transformers import AutoModelForCausalLM, Trainer

from hf_omni.checkpoint.contents import marker_info
from hf_omni.checkpoint.marker import MARKER
from hf_omni.cli import export

PICKLE_MAGIC = (b"\x80", b"PK\x03\x04")  # a protocol-2+ pickle; torch.save's zip


class Payload:
    """Unpickling this creates `path`: proof that code ran."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return open, (self.path, "w")


def test_the_guard_catches_each_way_to_unpickle(tmp_path):
    import torch.distributed.checkpoint as dcp

    torch.save({"a": torch.ones(2)}, tmp_path / "t.pt")
    dcp.save({"a": torch.ones(2)}, checkpoint_id=str(tmp_path / "dcp"))  # DCP's default layout: pickled .metadata
    rng = tmp_path / "rng"
    rng.mkdir()
    torch.save({"python": None}, rng / "rng_state.pth")
    with no_unpickling():
        with pytest.raises(Unpickled):
            torch.load(tmp_path / "t.pt", weights_only=True)
        with pytest.raises(Unpickled):
            dcp.FileSystemReader(str(tmp_path / "dcp")).read_metadata()
        with pytest.raises(Unpickled):
            pickle.loads(pickle.dumps(1))
        with pytest.raises(Unpickled):  # what OmniTrainer overrides
            Trainer._load_rng_state(type("T", (), {"args": type("A", (), {"world_size": 1})()})(), str(rng))
    assert torch.load(tmp_path / "t.pt", weights_only=True)["a"].sum() == 2  # restored afterwards


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    root = tmp_path_factory.mktemp("no_pickle")
    trainer = resume_trainer(root / "straight", "sharded_async", per_device=8)  # FSDP LoRA llm, async saves
    trainer.train()
    return root, full_state(trainer.model)


def planted(root, source):
    """A copy of `source` with pickles planted where Trainer and DCP would look, listed in its marker."""
    folder = root / "downloaded" / "checkpoint-5"
    shutil.copytree(source, folder)
    ran = root / "code_ran"
    for rel in ("optimizer.pt", "scheduler.pt", "scaler.pt", "rng_state.pth", "rng_state_0.pth",
                "training_args.bin", "llm/state/.metadata", "projector/state/.metadata"):
        (folder / rel).write_bytes(pickle.dumps(Payload(str(ran))))
    (folder / MARKER).write_text(json.dumps(marker_info(str(folder), 5, ["projector", "llm"])))
    return folder, ran


def test_resume_export_and_reload_read_no_pickle(straight, tmp_path):
    root, straight_state = straight
    folder, ran = planted(tmp_path, root / "straight" / "checkpoint-5")
    written = [p for p in (root / "straight" / "checkpoint-5").rglob("*") if p.is_file()]
    assert [p for p in written if p.read_bytes()[:4].startswith(PICKLE_MAGIC)] == []  # hf_omni writes no pickle
    with no_unpickling():
        resumed = resume_trainer(tmp_path / "resumed", "sharded_async", per_device=8, seed=5)
        resumed.train(resume_from_checkpoint=str(folder))
        resumed.plugin.load_state(str(folder), weights_only=True)  # load_best_model_at_end's path
        resumed.plugin.load_state(str(root / "straight" / "checkpoint-10"))
        resumed.save_model(str(tmp_path / "export"))
        export(str(root / "straight" / "checkpoint-10"), str(tmp_path / "cli_export"))
        reloaded = Captioner.from_pretrained(str(tmp_path / "export"))
        from_checkpoint = Captioner.from_pretrained(str(root / "straight" / "checkpoint-10"))
        llm = AutoModelForCausalLM.from_pretrained(str(tmp_path / "cli_export" / "llm"))
    assert not ran.exists()
    assert resumed.state.global_step == 10
    resumed_state = full_state(resumed.model)
    for key, value in straight_state.items():
        assert torch.equal(value, resumed_state[key]), key
    for model in (reloaded, from_checkpoint):  # step 10 both: the resumed run's export, the straight checkpoint
        for key, value in model.projector.state_dict().items():
            assert torch.equal(value, straight_state[f"projector.{key}"]), key
    ids = torch.arange(1, 9).unsqueeze(0)
    with torch.no_grad():
        torch.testing.assert_close(llm(input_ids=ids).logits, from_checkpoint.llm(input_ids=ids).logits)
