"""A LoRA module's frozen base, written once per run: checkpoints hold its adapter and refer to the base, which
loads as is, moves with the run, is checked and verified with the checkpoint, exported into the module folder, kept
by rotation while referred to, and written again only by a run that cannot use it."""

import json
import os
import shutil

import pytest
import torch
from helpers import Captioner, make_args, tiny_data, tiny_model
from transformers import AutoModelForCausalLM

from hf_omni import OmniTrainer
from hf_omni.checkpoint.contents import check_complete, rotate
from hf_omni.checkpoint.marker import MARKER
from hf_omni.cli import export
from hf_omni.files.lora_base import has_fixed_base, weights_folder

MODULES = {
    "vision": {"trainable": False},
    "projector": {"learning_rate": 3e-3},
    "llm": {"learning_rate": 1e-2, "lora": {"r": 4, "target_modules": ["q_proj", "v_proj"]}},
}


def run(out, steps=10, resume=None, model=None, modules=MODULES, **kw):
    model = model or tiny_model()
    args = make_args(out, max_steps=steps, save_strategy="steps", save_steps=5, modules=modules, **kw)
    trainer = OmniTrainer(model=model, args=args, train_dataset=tiny_data(model, 48))
    trainer.train(resume_from_checkpoint=resume)
    return trainer, model


def bases(run_dir) -> list[str]:
    frozen = run_dir / "frozen"
    return sorted(n for n in os.listdir(frozen) if (frozen / n / "hf_omni_base.json").exists())


def base_of(checkpoint) -> dict:
    return json.loads((checkpoint / MARKER).read_text())["bases"]["llm"]


def state_equal(a: dict, b: dict) -> None:
    """Bitwise, but for ViT's pooler (its config does not record `add_pooling_layer=False`: a reload adds one)."""
    a, b = ({k: v for k, v in s.items() if not k.startswith("vision.pooler.")} for s in (a, b))
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


def test_base_is_written_once_and_each_checkpoint_loads_as_is(tmp_path):
    trainer, model = run(tmp_path, steps=10)
    (name,) = bases(tmp_path)  # one base for both checkpoints
    base = tmp_path / "frozen" / name
    assert name.startswith("llm-") and sorted(os.listdir(base)) == ["config.json", "generation_config.json",
                                                                   "hf_omni_base.json", "model.safetensors"]
    for step in (5, 10):
        ckpt = tmp_path / f"checkpoint-{step}"
        assert base_of(ckpt)["name"] == name and base_of(ckpt)["files"]["model.safetensors"] > 0
        assert sorted(p.name for p in (ckpt / "llm").iterdir()) == [
            "adapter_config.json", "adapter_model.safetensors", "state", "tokenizer.json", "tokenizer_config.json"]
        adapter = json.loads((ckpt / "llm" / "adapter_config.json").read_text())
        assert adapter["base_model_name_or_path"] == str(base)  # PEFT's own reference: absolute, where it is
    adapter_bytes = (tmp_path / "checkpoint-10" / "llm" / "adapter_model.safetensors").stat().st_size
    assert adapter_bytes * 20 < (base / "model.safetensors").stat().st_size  # what each save writes for it
    # transformers' own loader follows the adapter's base reference: the live LLM's outputs
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "checkpoint-10" / "llm").eval()
    ids = torch.arange(3, 19).reshape(2, 8)
    model.llm.eval()
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids).logits, model.llm(input_ids=ids).logits, atol=1e-6,
                                   rtol=0)
    state_equal(Captioner.from_pretrained(tmp_path / "checkpoint-10").state_dict(), model.state_dict())


def test_resume_in_the_same_run_uses_the_base_and_another_run_writes_its_own(tmp_path):
    straight, straight_model = run(tmp_path / "straight", steps=10)
    run(tmp_path / "split", steps=10)
    os.remove(tmp_path / "split" / "checkpoint-10" / MARKER)  # it died before step 10's save finished
    (name,) = bases(tmp_path / "split")
    resumed, resumed_model = run(tmp_path / "split", steps=10, resume=True, model=tiny_model(seed=1))
    assert bases(tmp_path / "split") == [name] and base_of(tmp_path / "split" / "checkpoint-10")["name"] == name
    state_equal(resumed_model.state_dict(), straight_model.state_dict())  # bitwise, base read from frozen/
    # resuming from another run's checkpoint: that run's rotation may delete its base, so this run writes one
    run(tmp_path / "other", steps=10, resume=str(tmp_path / "split" / "checkpoint-5"))
    (other,) = bases(tmp_path / "other")
    assert other != name and base_of(tmp_path / "other" / "checkpoint-10")["name"] == other


def with_vision_from_a_folder(folder) -> Captioner:
    """tiny_model with its (frozen) encoder loaded from `folder`: its recorded source, outside the run."""
    built = tiny_model()
    built.vision.save_pretrained(folder)
    vision = type(built.vision).from_pretrained(folder)
    return Captioner.from_modules({"vision": vision, "projector": built.projector, "llm": built.llm},
                                  processors=built.processors)


def test_a_moved_run_finds_its_base_and_a_checkpoint_moved_alone_says_what_is_missing(tmp_path):
    trainer, model = run(tmp_path / "a", steps=5, model=with_vision_from_a_folder(tmp_path / "vit"))
    shutil.move(tmp_path / "a", tmp_path / "b")  # the whole output_dir: the absolute reference is stale
    ckpt = tmp_path / "b" / "checkpoint-5"
    assert not os.path.exists(base_of(ckpt)["folder"])
    assert check_complete(str(ckpt))["bases"]["llm"]["name"] == bases(tmp_path / "b")[0]
    state_equal(Captioner.from_pretrained(ckpt).state_dict(), model.state_dict())
    empty = Captioner.from_pretrained(ckpt, empty_init=True)  # on meta; each module read where it is now
    run(tmp_path / "b", steps=10, resume=str(ckpt), model=empty)
    assert len(bases(tmp_path / "b")) == 1  # found in this run's frozen/: used, not written again
    shutil.copytree(ckpt, tmp_path / "alone")
    with pytest.raises(FileNotFoundError, match=r"its LoRA base llm-\w+ is neither at .* nor in a frozen/ folder"):
        check_complete(str(tmp_path / "alone"))
    with pytest.raises(FileNotFoundError, match="move a checkpoint together with its run's frozen/ folder"):
        weights_folder(str(tmp_path / "alone" / "llm"))  # what every loader of the module folder asks


def test_verify_and_checks_cover_the_base(tmp_path):
    run(tmp_path, steps=5, verify_checkpoint=True)
    ckpt = tmp_path / "checkpoint-5"
    record = base_of(ckpt)
    weights = os.path.join(record["folder"], "model.safetensors")
    assert set(record["sha256"]) == set(record["files"]) == {"config.json", "generation_config.json",
                                                             "model.safetensors"}
    data = bytearray(open(weights, "rb").read())
    data[-7] ^= 0x10  # same size: only the digests see it
    open(weights, "wb").write(bytes(data))
    with pytest.raises(ValueError, match=r"module 'llm'.s LoRA base .* file model.safetensors does not match its "
                                         r"sha256 at bytes 0-"):
        run(tmp_path, steps=10, resume=str(ckpt), verify_checkpoint=True)
    with pytest.raises(ValueError, match="does not match its sha256"):  # the CLI checks what was recorded
        export(str(ckpt), str(tmp_path / "out"))
    open(weights, "ab").write(b"x")  # any run: sizes
    with pytest.raises(ValueError, match=r"LoRA base .*: file model.safetensors has \d+ bytes, \d+ were written"):
        check_complete(str(ckpt), verify=False)
    os.remove(weights)
    with pytest.raises(ValueError, match=r"LoRA base .*: file model.safetensors is missing"):
        check_complete(str(ckpt), verify=False)


def test_export_copies_the_base_in(tmp_path):
    trainer, model = run(tmp_path, steps=5)
    export(str(tmp_path / "checkpoint-5"), str(tmp_path / "out"))
    llm = tmp_path / "out" / "llm"
    assert (llm / "model.safetensors").read_bytes() == (tmp_path / "frozen" / bases(tmp_path)[0] /
                                                        "model.safetensors").read_bytes()
    assert json.loads((llm / "adapter_config.json").read_text())["base_model_name_or_path"] is None
    shutil.rmtree(tmp_path / "frozen")  # the export stands alone
    state_equal(Captioner.from_pretrained(tmp_path / "out").state_dict(), model.state_dict())


def test_rotation_keeps_a_base_while_a_checkpoint_refers_to_it(tmp_path):
    run(tmp_path, steps=10, save_total_limit=1)
    (first,) = bases(tmp_path)
    assert sorted(p.name for p in tmp_path.glob("checkpoint-*")) == ["checkpoint-10"]
    assert rotate(str(tmp_path), 1) == [] and bases(tmp_path) == [first]  # checkpoint-10 refers to it: kept
    run(tmp_path, steps=15, save_total_limit=2, model=tiny_model(seed=2))  # a new run into the same folder
    (second,) = bases(tmp_path)  # checkpoint-10 (saved again by the new run) and 15 refer to the new base: the
    assert second != first  # first went with the last checkpoint that referred to it
    assert base_of(tmp_path / "checkpoint-10")["name"] == base_of(tmp_path / "checkpoint-15")["name"] == second
    assert (tmp_path / "frozen" / "vision").is_dir()  # a frozen module's source is no LoRA base: never rotated


def test_only_a_base_that_cannot_change_is_written_apart():
    model = tiny_model()
    from peft import LoraConfig, inject_adapter_in_model

    inject_adapter_in_model(LoraConfig(r=2, target_modules=["q_proj"]), model.llm)
    for name, p in model.llm.named_parameters():
        p.requires_grad_(".lora_" in name)
    assert has_fixed_base(model.llm) and not has_fixed_base(model.projector)  # no adapter: the whole folder
    model.llm.get_input_embeddings().weight.requires_grad_(True)  # a base tensor trains: rewritten every save
    assert not has_fixed_base(model.llm)
    vision = tiny_model().vision
    inject_adapter_in_model(LoraConfig(r=2, target_modules=["q_proj"]), vision)
    vision.add_module("norm_stats", torch.nn.BatchNorm1d(4))  # running statistics change in training
    for name, p in vision.named_parameters():
        p.requires_grad_(".lora_" in name)
    assert not has_fixed_base(vision)


def test_a_base_that_trains_is_written_with_each_checkpoint_even_when_one_was_recorded(tmp_path):
    """A recorded base (written before, or adopted at resume) serves only a module whose base cannot change: one
    whose base trains gets its whole folder at every save, never a reference to stale base weights."""
    trainer, model = run(tmp_path, steps=5)
    checkpointer = trainer.plugin.checkpointer
    assert "llm" in checkpointer.bases
    checkpointer.states["llm"]._fixed_base = False  # as for a run that also trains base tensors
    trainer.plugin.save_state(str(tmp_path / "again"), step=5)
    assert (tmp_path / "again" / "llm" / "model.safetensors").exists()
    assert "bases" not in json.loads((tmp_path / "again" / MARKER).read_text())
