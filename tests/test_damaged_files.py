"""A damaged file of a checkpoint, one process: each kind (a same-size garbled safetensors header, a header whose
offsets pass the file's end, a truncated `state/` shard, DCP's sharding record, bad JSON, a changed tensor with
`verify_checkpoint`, an adopted model's `released/` copy) is one `DamagedFileError` naming the file and what to do,
raised by a resume before any step and by `hf-omni export` before anything is written; so is a JSON file a resume
reads with a key renamed (valid JSON, found otherwise only when it is read)."""

import json
import os
import shutil
import struct

import pytest
from checkpoint_scenario import make_trainer
from helpers import make_args
from released_models import BUILDERS, MODULES, Rows, collate
from transformers import TrainerCallback

from hf_omni import OmniModel, OmniTrainer
from hf_omni.checkpoint.file_checks import problem
from hf_omni.cli import main
from hf_omni.core.errors import DamagedFileError
from hf_omni.files.safetensors_index import SafetensorsIndex

SHARD = "llm/state/shard-00001-00001-of-00002.safetensors"
ADOPTED = {"vision": {"trainable": False}, "projector": {"learning_rate": 1e-2},
           "llm": {"lora": {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]}, "learning_rate": 1e-3}}


def composed_trainer(out, callbacks=()):
    return make_trainer(out, callbacks=callbacks, max_steps=4, save_steps=2, save_total_limit=None,
                        gradient_accumulation_steps=1, verify_checkpoint=True)


def adopted_trainer(out, callbacks=()):
    model = OmniModel.from_model(BUILDERS["llava"](0), modules=MODULES["llava"])
    args = make_args(out, modules=ADOPTED, save_strategy="steps", save_steps=2, max_steps=4)
    return OmniTrainer(model=model, args=args, train_dataset=Rows("llava", model.released, 32), data_collator=collate,
                       callbacks=list(callbacks))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """A run of each kind stopped after its checkpoint at step 2 (the later steps are what a resume would run)."""
    out = {}
    for kind, build in (("composed", composed_trainer), ("adopted", adopted_trainer)):
        trainer = build(tmp_path_factory.mktemp(kind))
        trainer.args.max_steps = 2
        trainer.train()
        out[kind] = trainer.args.output_dir
    return out


# -- damage, each keeping the file's size unless it says otherwise -------------------------------------------------
def garble_header(path):
    data = bytearray(open(path, "rb").read())
    data[8:10] = b"#!"  # the header's opening `{"`
    open(path, "wb").write(data)


def offsets_past_end(path):
    data = open(path, "rb").read()
    length = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8:8 + length])
    begin, end = max((v["data_offsets"] for k, v in header.items() if k != "__metadata__"), key=lambda o: o[1])
    larger = int("9" * len(str(end)))
    assert larger > end
    old, new = f'"data_offsets":[{begin},{end}]'.encode(), f'"data_offsets":[{begin},{larger}]'.encode()
    assert data.count(old) == 1
    open(path, "wb").write(data.replace(old, new))


def truncate(path):
    data = open(path, "rb").read()
    open(path, "wb").write(data[:len(data) // 2])


def lose_sharding_record(path):
    data = open(path, "rb").read()
    assert b"saved_offsets" in data
    open(path, "wb").write(data.replace(b"saved_offsets", b"saved_offsetz"))


def bad_json(path):
    data = bytearray(open(path, "rb").read())
    data[0:1] = b"#"
    open(path, "wb").write(data)


def rename_key(old: str, new: str):
    """Valid JSON with a key renamed, as a hand edit leaves it (the reader would fail only when it reads it)."""
    def rename(path):
        value = json.load(open(path))
        value[new] = value.pop(old)
        json.dump(value, open(path, "w"))

    return rename


def change_a_tensor(path):  # a valid header over other bytes: only the recorded sha256 tells
    data = bytearray(open(path, "rb").read())
    data[-1] ^= 0xFF
    open(path, "wb").write(data)


# -- helpers --------------------------------------------------------------------------------------------------------
def listing(root):
    """Every file and folder under `root` with its size and mtime: what "nothing was written" compares."""
    out = {}
    for folder, dirs, names in os.walk(root):
        for name in dirs + names:
            path = os.path.join(folder, name)
            out[os.path.relpath(path, root)] = (os.path.getsize(path), os.stat(path).st_mtime_ns)
    return out


class Steps(TrainerCallback):
    def __init__(self):
        self.begun = []

    def on_step_begin(self, args, state, control, **kwargs):
        self.begun.append(state.global_step)


def damaged_copy(runs, tmp_path, kind, rel, damage):
    run = tmp_path / "run"
    shutil.copytree(runs[kind], run)
    damage(str(run / "checkpoint-2" / rel))
    return run, run / "checkpoint-2"


def assert_names(error, checkpoint, rel):
    message = str(error.value)
    assert error.value.path == str(checkpoint / rel), message
    assert f"checkpoint {checkpoint}: " in message and (f"file {rel} " in message or rel == "hf_omni_checkpoint.json")
    assert "earlier checkpoint" in message


RESUMES = {
    "garbled model header": ("composed", "projector/model.safetensors", garble_header),
    "garbled adapter header": ("composed", "llm/adapter_model.safetensors", garble_header),
    "offsets past the end": ("composed", "projector/model.safetensors", offsets_past_end),
    "garbled shard header": ("composed", SHARD, garble_header),
    "shard offsets past the end": ("composed", SHARD, offsets_past_end),
    "truncated shard": ("composed", SHARD, truncate),
    "shard without DCP offsets": ("composed", SHARD, lose_sharding_record),
    "changed tensor (verify_checkpoint)": ("composed", "projector/model.safetensors", change_a_tensor),
    "bad marker": ("composed", "hf_omni_checkpoint.json", bad_json),
    "bad root config": ("composed", "config.json", bad_json),
    "bad trainer state": ("composed", "trainer_state.json", bad_json),
    "bad adapter config": ("composed", "llm/adapter_config.json", bad_json),
    "bad optimizer json": ("composed", "llm/state/optimizer.json", bad_json),
    "renamed trainer state key": ("composed", "trainer_state.json", rename_key("global_step", "global_steps")),
    "renamed optimizer key": ("composed", "llm/state/optimizer.json", rename_key("param_groups", "groups")),
    "renamed scheduler key": ("composed", "projector/state/scheduler.json", rename_key("last_epoch", "epoch")),
    "adopted: garbled projector": ("adopted", "projector/model.safetensors", garble_header),
    "adopted: garbled released copy": ("adopted", "released/model.safetensors", garble_header),
}


@pytest.mark.parametrize("case", list(RESUMES))
def test_resume_names_the_damaged_file_before_any_step_and_writes_nothing(runs, tmp_path, case):
    kind, rel, damage = RESUMES[case]
    run, checkpoint = damaged_copy(runs, tmp_path, kind, rel, damage)
    before, steps = listing(run), Steps()
    trainer = (composed_trainer if kind == "composed" else adopted_trainer)(run, callbacks=[steps])
    with pytest.raises(DamagedFileError) as error:
        trainer.train(resume_from_checkpoint=str(checkpoint))
    assert_names(error, checkpoint, rel)
    assert steps.begun == [] and listing(run) == before


EXPORTS = {
    "garbled model header": ("composed", "projector/model.safetensors", garble_header),
    "offsets past the end": ("composed", "llm/adapter_model.safetensors", offsets_past_end),
    "changed tensor (verify_checkpoint)": ("composed", "llm/adapter_model.safetensors", change_a_tensor),
    "bad adapter config": ("composed", "llm/adapter_config.json", bad_json),
    "garbled released copy": ("adopted", "released/model.safetensors", garble_header),
    "released offsets past the end": ("adopted", "released/model.safetensors", offsets_past_end),
    "bad released config": ("adopted", "released/config.json", bad_json),
}


@pytest.mark.parametrize("existing", [False, True], ids=["new", "empty"])
@pytest.mark.parametrize("case", list(EXPORTS))
def test_export_names_the_damaged_file_and_writes_nothing(runs, tmp_path, case, existing):
    kind, rel, damage = EXPORTS[case]
    run, checkpoint = damaged_copy(runs, tmp_path, kind, rel, damage)
    out = tmp_path / "export"
    if existing:
        out.mkdir()
    before = listing(tmp_path)
    with pytest.raises(DamagedFileError) as error:
        main(["export", str(checkpoint), str(out)])
    assert_names(error, checkpoint, rel)
    assert listing(tmp_path) == before and out.exists() == existing  # no partial folder either


def test_undamaged_checkpoints_pass_and_export(runs, tmp_path):
    for kind, run in runs.items():
        for folder, _, names in os.walk(run):
            assert [problem(os.path.join(folder, n)) for n in names] == [None] * len(names), folder
        main(["export", os.path.join(run, "checkpoint-2"), str(tmp_path / kind)])
        assert (tmp_path / kind / "config.json").exists()


def test_a_damaged_source_read_outside_a_checkpoint_names_itself(runs, tmp_path):
    """A frozen module's source is no checkpoint file: its reader names it when safetensors cannot open it."""
    source = tmp_path / "vision"
    shutil.copytree(os.path.join(runs["composed"], "frozen", "vision"), source)
    garble_header(str(source / "model.safetensors"))
    with pytest.raises(DamagedFileError, match=f"{source / 'model.safetensors'} cannot be read as safetensors"):
        SafetensorsIndex.for_weights(str(source))


def test_each_rank_parses_only_its_share_of_the_files(runs, tmp_path):
    """At resume file i of the marker's sorted list is checked by rank i mod world alone (the ranks then agree)."""
    from hf_omni.checkpoint.contents import check_complete
    from hf_omni.checkpoint.marker import read_marker

    run, checkpoint = damaged_copy(runs, tmp_path, "composed", SHARD, garble_header)
    index = sorted(read_marker(str(checkpoint))["files"]).index(SHARD)
    for world in (2, 3):
        for rank in range(world):
            if rank == index % world:
                with pytest.raises(DamagedFileError, match=f"file {SHARD} is damaged"):
                    check_complete(str(checkpoint), share=(rank, world))
            else:
                check_complete(str(checkpoint), share=(rank, world))
