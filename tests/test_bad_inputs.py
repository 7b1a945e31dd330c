"""The catalogue of hostile or broken inputs: arguments and YAML, crafted paths in a root config.json, checkpoint
folders. Each gets one clear error naming what is wrong (module and key, module and file) before anything is
computed, and nothing on disk changes. (Model-time argument errors: tests/test_arguments.py; model composition:
tests/test_modeling.py.)"""

import json
import os

import pytest
from helpers import Captioner, tiny_model

from hf_omni import OmniTrainingArguments
from hf_omni.cli import export

# -- arguments ---------------------------------------------------------------------------------------------
PARSE_ERRORS = [
    (dict(modules={"llm": {"lr": 1}}), "modules.llm.lr"),
    (dict(modules={"llm": {"learning_rate": -1}}), "modules.llm.learning_rate"),
    (dict(learning_rate=-1.0), "learning_rate"),
    (dict(modules={"llm": {"learning_rate": "fast"}}), "modules.llm.learning_rate"),
    (dict(modules={"llm": {"trainable": "no"}}), "modules.llm.trainable"),
    (dict(modules={"llm": {"parallel": "tp"}}), "modules.llm.parallel"),
    (dict(modules={"llm": {"optim": "adamw_nonexistent"}}), "modules.llm.optim"),
    (dict(modules={"llm": {"lr_scheduler_type": "zigzag"}}), "modules.llm.lr_scheduler_type"),
    (dict(modules={"llm": {"lr_scheduler_type": "reduce_lr_on_plateau"}}), "modules.llm.lr_scheduler_type"),
    (dict(modules={"llm": {"lora": {"rank": 3}}}), "modules.llm.lora"),
    (dict(modules={"llm": {"fsdp_plugin": {"shard": True}}}), "modules.llm.fsdp_plugin.shard"),
    (dict(modules={"llm": {"fsdp_plugin": {"min_num_params": 10, "transformer_cls_names_to_wrap": ["X"]}}}),
     "modules.llm.fsdp_plugin.min_num_params"),
    (dict(modules={"llm": {"learning_rate": None}}), "modules.llm.learning_rate"),
    (dict(modules={"llm": {"fsdp_plugin": {"mixed_precision": "bf8"}}}), "modules.llm.fsdp_plugin.mixed_precision"),
    (dict(fsdp_plugin={"mixed_precision": {"param_dtype": "int8"}}), "fsdp_plugin.mixed_precision.param_dtype"),
    (dict(modules={"llm": 3}), "modules.llm"),
    (dict(fsdp="full_shard"), "fsdp"),
    (dict(fsdp_config={"min_num_params": 1}), "fsdp_config"),
    (dict(gradient_checkpointing=True), "gradient_checkpointing"),
    (dict(grad_clip_scope="global", modules={"llm": {"max_grad_norm": 1.0}}), "modules.llm.max_grad_norm"),
    (dict(fsdp_scope="model", modules={"llm": {"parallel": "ddp"}}), "modules.llm.parallel"),
    (dict(fsdp_scope="model", modules={"llm": {"fsdp_plugin": {"cpu_offload": True}}}), "modules.llm.fsdp_plugin"),
    (dict(parallel="zero3"), "parallel"),
    (dict(modules="{not json"), "modules"),
    (dict(modules={"llm": {"fsdp_plugin": {"min_num_params": 10}}},
          fsdp_plugin={"transformer_cls_names_to_wrap": ["LlamaDecoderLayer"]}), "modules.llm.fsdp_plugin.min_num_params"),
    (dict(deepspeed={"zero_optimization": {"stage": 3}}), "deepspeed"),
    (dict(hub_layout="folders"), "hub_layout"),
    (dict(modules={"llm": {"hub_model_id": "org/bad id"}}), "modules.llm.hub_model_id"),
    (dict(modules={"llm": {"push_to_hub": "yes"}}), "modules.llm.push_to_hub"),
    (dict(activation_checkpointing=True, gradient_checkpointing=True), "gradient_checkpointing"),
    (dict(torch_compile=True), "torch_compile"),
    (dict(fp16=True, use_cpu=True), "fp16"),
    (dict(modules={"llm": {"fsdp_plugin": {"cpu_ram_efficient_loading": True}}}),
     "modules.llm.fsdp_plugin.cpu_ram_efficient_loading"),
    (dict(fsdp_plugin={"mixed_precision": "fp16"}), "fsdp_plugin.mixed_precision"),
    (dict(modules={"llm": {"ddp_bucket_cap_mb": 0}}), "modules.llm.ddp_bucket_cap_mb"),
]


@pytest.mark.parametrize("overrides,where", PARSE_ERRORS)
def test_parse_time_errors_name_module_and_key(tmp_path, overrides, where):
    with pytest.raises(ValueError) as err:
        OmniTrainingArguments(output_dir=str(tmp_path), **overrides)
    assert str(err.value).startswith(where + ":") or str(err.value).startswith(where + "."), str(err.value)


BAD_YAML = {
    "not a mapping": ("- a\n- b\n", "ValueError|TypeError|AttributeError"),
    "a string where a dict goes": ("output_dir: x\nmodules: {llm: {lora: 8}}\n", r"modules\.llm\.lora"),
    "a number that is not one": ("output_dir: x\nlearning_rate: fast\n", r"learning_rate"),
}


@pytest.mark.parametrize("case", list(BAD_YAML))
def test_bad_yaml_files_fail_with_a_clear_error(tmp_path, case):
    from transformers import HfArgumentParser

    text, message = BAD_YAML[case]
    path = tmp_path / "train.yaml"
    path.write_text(text)
    with pytest.raises((ValueError, TypeError, AttributeError), match=message if "|" not in message else None):
        HfArgumentParser(OmniTrainingArguments).parse_yaml_file(str(path))



@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("saved")
    tiny_model().save_pretrained(root / "model")
    return root / "model"


def crafted(tmp_path, saved, prepare=None, **changes) -> str:
    """A copy of the saved model whose root config.json has the llm entry changed (after `prepare(folder)`), with a
    marker listing every file: it looks like a complete checkpoint."""
    import shutil

    from hf_omni.checkpoint.contents import marker_info
    from hf_omni.checkpoint.marker import write_marker

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


def _listed(folder, rel, text):
    """Rewrite `rel` and list its new size in the marker: a crafted file, not a truncated one."""
    from hf_omni.checkpoint.contents import marker_info

    (folder / rel).write_text(text)
    _marker(folder, lambda d: d.update(files=marker_info(str(folder), 5, [])["files"]))


def _other_groups(folder):
    state = json.loads((folder / "llm" / "state" / "optimizer.json").read_text())
    state["param_groups"][0]["params"] = ["lm_head.weight"]
    _listed(folder, "llm/state/optimizer.json", json.dumps(state))


CHECKPOINT_CASES = {
    "missing": (lambda f: __import__("shutil").rmtree(f), "does not exist"),
    "no marker": (lambda f: os.remove(f / "hf_omni_checkpoint.json"), "no hf_omni_checkpoint.json: it is incomplete"),
    "malformed marker": (lambda f: (f / "hf_omni_checkpoint.json").write_text("{not json"), "is not valid JSON"),
    "marker without files": (lambda f: _marker(f, lambda d: d.pop("files")), "has no file list"),
    "truncated weights": (lambda f: (f / "projector" / "model.safetensors").write_bytes(b"x" * 10),
                          r"projector/model\.safetensors has 10 bytes"),
    "LoRA base nowhere": (lambda f: _marker(f, lambda d: d["bases"]["llm"].update(name="llm-00000000", folder=None)),
                          r"its LoRA base llm-00000000 is neither at its recorded path nor in a frozen/ folder"),
    "LoRA base name a path": (lambda f: _marker(f, lambda d: d["bases"]["llm"].update(name="../../etc")),
                              r"'\.\./\.\./etc' is not the name of a frozen folder"),
    "LoRA base record malformed": (lambda f: _marker(f, lambda d: d["bases"].update(llm=[])),
                                   r"malformed record of module 'llm'.s LoRA base"),
    "missing scheduler": (lambda f: os.remove(f / "llm" / "state" / "scheduler.json"), r"file llm/state/scheduler\.json is missing"),
    "unlisted file": (lambda f: (f / "llm" / "extra.bin").write_bytes(b"x"), r"file llm/extra\.bin is not listed"),
    "marker path outside": (lambda f: _marker(f, lambda d: d["files"].update({"../escape": 1})),
                            "lists a path outside it"),
    "older format": (lambda f: _marker(f, lambda d: d.update(format=1)), "has format 1, this hf_omni reads format 2"),
    "malformed optimizer.json": (lambda f: _listed(f, "llm/state/optimizer.json", "{not json"),
                                 r"llm/state/optimizer\.json is not valid JSON"),
    "optimizer.json of another model": (_other_groups, r"optimizer\.json: its param groups hold other parameters"),
    "scheduler.json not a state": (lambda f: _listed(f, "llm/state/scheduler.json", "[1, 2]"),
                                   r"scheduler\.json is not an hf_omni scheduler\.json"),
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


# -- model-time: a trainable submodule FSDP would leave unreduced --------------------------------------------
@pytest.mark.parametrize("trainable", [True, False])
def test_a_trainable_submodule_in_fsdp_ignored_modules_is_refused_at_prepare(trainable):
    """FSDP never reduces an ignored submodule's gradients (each rank would step its own copy, and the first clip
    mixes plain tensors with DTensors): one that trains is refused at prepare, before anything is wrapped or
    computed, naming the module, the key and its parameters; a frozen one is accepted."""
    from accelerate import Accelerator

    from hf_omni import OmniPlugin

    model = tiny_model()
    llm = {"parallel": "fsdp", "trainable": trainable, "fsdp_plugin": {"ignored_modules": r"model\.layers\.0\.mlp"}}
    plugin = OmniPlugin(modules={"llm": llm}, defaults={"learning_rate": 1e-3})
    if not trainable:
        plugin.prepare(Accelerator(cpu=True), model, num_training_steps=2)
        return
    with pytest.raises(ValueError, match=r"^fsdp_plugin\.ignored_modules: 'llm\\\.model\\\.layers\\\.0\\\.mlp' holds "
                       r"parameters that train \(llm\.model\.layers\.0\.mlp\.\w+\.weight"):  # one wrap of the model
        OmniPlugin(defaults={"learning_rate": 1e-3, "fsdp_scope": "model", "fsdp_plugin": {
            "ignored_modules": r"llm\.model\.layers\.0\.mlp"}}).prepare(Accelerator(cpu=True), tiny_model(), 2)
    with pytest.raises(ValueError, match=r"^modules\.llm\.fsdp_plugin\.ignored_modules: 'model\\\.layers\\\.0\\\.mlp' "
                       r"holds parameters that train \(model\.layers\.0\.mlp\.\w+\.weight"):
        plugin.prepare(Accelerator(cpu=True), model, num_training_steps=2)
    assert plugin.prepared is None and not any(p.grad is not None for p in model.parameters())
