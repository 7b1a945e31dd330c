"""Offline encoding of a frozen module: training from the cache equals training with the module (shuffled rows,
torch and `datasets` sources), the module is never materialised while training from it, a stale cache is
recomputed or refused naming what changed, a killed encode is never used, exports and `empty_init` work."""

import json
import os

import pytest
import torch
from helpers import make_args, step_losses, tiny_data, tiny_model
from transformers import TrainerCallback

from hf_omni import OmniTrainer
from hf_omni.core.errors import OmniArgumentError
from hf_omni.files import weights
from hf_omni.offline import cache as offline_cache
from hf_omni.offline import serve
from hf_omni.parallel import driver
from hf_omni.testing.digits import Captioner

MODULES = {"vision": {"trainable": False}, "projector": {"learning_rate": 3e-3},
           "llm": {"learning_rate": 1e-3, "lora": {"r": 4, "target_modules": ["q_proj", "v_proj"]}}}


class VisionNeverReal(TrainerCallback):
    """At every step: each parameter and buffer of the offline module is on the meta device."""

    def __init__(self):
        self.checked = 0

    def on_step_end(self, args, state, control, model=None, **kwargs):
        tensors = list(model.vision.parameters()) + list(model.vision.buffers())
        assert tensors and all(t.is_meta for t in tensors)
        self.checked += 1


def trainer(out, model=None, data=None, steps=6, eval_data=None, **kw):
    model = model if model is not None else tiny_model()
    args = make_args(out, max_steps=steps, modules=MODULES, train_sampling_strategy="random",
                     per_device_train_batch_size=4, **kw)
    return OmniTrainer(model=model, args=args, train_dataset=data if data is not None else tiny_data(model, 32),
                       eval_dataset=eval_data)


def encodes(monkeypatch) -> list:
    calls, original = [], offline_cache.encode_rows
    monkeypatch.setattr(offline_cache, "encode_rows", lambda *a, **k: calls.append(1) or original(*a, **k))
    return calls


def as_datasets(data):
    from datasets import Dataset

    rows = [data[i] for i in range(len(data))]
    return Dataset.from_dict({k: [r[k].tolist() for r in rows] for k in rows[0]})


@pytest.mark.parametrize("source", ["torch", "datasets"])
def test_offline_training_equals_online_and_never_materialises_the_module(tmp_path, source):
    model = tiny_model()
    data = tiny_data(model, 32) if source == "torch" else as_datasets(tiny_data(model, 32))
    held_out = torch.utils.data.Subset(__import__("hf_omni.testing.digits", fromlist=["x"]).load_splits(model.processors["llm"])[1], range(24))
    online = trainer(tmp_path / "online", model, data, eval_data=held_out)
    online.train()
    offline_model = tiny_model()
    offline = trainer(tmp_path / "offline", offline_model, data, eval_data=held_out, offline_modules=["vision"])
    watch = VisionNeverReal()
    offline.add_callback(watch)
    offline.train()
    assert watch.checked == 6 and offline.plugin.wrapped["vision"] == "offline"
    assert step_losses(offline) == pytest.approx(step_losses(online), abs=1e-6)
    assert os.path.isfile(tmp_path / "offline" / "offline_cache" / "vision-eval" / "manifest.json")
    assert offline.evaluate()["eval_loss"] == pytest.approx(online.evaluate()["eval_loss"], abs=1e-6)
    with pytest.raises(ValueError, match=r"modules \['vision'\] are offline .* has no cache"):
        offline.evaluate(eval_dataset=held_out)  # raw rows would reach the encoder on the meta device
    for key, value in model.state_dict().items():
        if not key.startswith("vision."):
            torch.testing.assert_close(offline_model.state_dict()[key], value, atol=1e-6, rtol=0)
    offline.save_model(str(tmp_path / "export"))  # the vision folder comes from its recorded source
    reloaded = Captioner.from_pretrained(str(tmp_path / "export"))
    batch = {k: torch.stack([tiny_data(model, 4)[i][k] for i in range(4)]) for k in ("pixel_values", "input_ids")}
    model.eval(), reloaded.eval()
    with torch.no_grad():
        torch.testing.assert_close(reloaded(**batch).logits, model(**batch).logits, atol=1e-5, rtol=0)


def test_a_valid_cache_is_reused_a_stale_one_recomputed_or_refused(tmp_path, monkeypatch):
    calls = encodes(monkeypatch)
    cache = str(tmp_path / "cache")
    trainer(tmp_path / "a", offline_modules=["vision"], offline_cache_dir=cache).train()
    trainer(tmp_path / "b", offline_modules=["vision"], offline_cache_dir=cache).train()
    assert len(calls) == 1  # the second run read the cache

    def refused(model=None, data=None, what=""):
        with pytest.raises(ValueError, match=rf"module 'vision' is not valid \({what} changed\)"):
            trainer(tmp_path / "c", model, data, offline_modules=["vision"], offline_cache_dir=cache,
                    offline_cache="read_only").train()

    changed = tiny_model()
    with torch.no_grad():
        changed.vision.embeddings.patch_embeddings.projection.weight[0, 0, 0, 0] += 1e-3
    refused(changed, what="weights")
    refused(tiny_model().to(torch.float64), what="weights, dtype")
    refused(data=tiny_data(tiny_model(), 36), what="dataset, rows")

    class OtherEncoder(Captioner):
        @__import__("hf_omni").offline_encoder(module="vision", inputs=["pixel_values"], output="image_features")
        def encode_image(self, pixel_values):
            return self.vision(pixel_values=pixel_values).last_hidden_state * 1.0

    other = OtherEncoder.from_modules(tiny_model().omni_modules(), processors=tiny_model().processors)
    refused(other, what="encoder")
    expected = offline_cache.tensors_hash(dict(changed.vision.state_dict()))
    trainer(tmp_path / "d", changed, offline_modules=["vision"], offline_cache_dir=cache).train()
    assert len(calls) == 2  # auto: recomputed
    manifest = json.loads(open(os.path.join(cache, "vision-train", "manifest.json")).read())
    assert manifest["fingerprint"]["weights"] == expected


def test_a_killed_encode_is_never_used(tmp_path, monkeypatch):
    def killed(*args, **kwargs):
        raise KeyboardInterrupt("killed mid-encode")

    monkeypatch.setattr(offline_cache, "encode_rows", killed)
    with pytest.raises(KeyboardInterrupt):
        trainer(tmp_path, offline_modules=["vision"]).train()
    assert os.path.isdir(tmp_path / "offline_cache" / "vision-train.partial")
    assert not os.path.exists(tmp_path / "offline_cache" / "vision-train")
    monkeypatch.undo()
    with pytest.raises(ValueError, match="no complete cache changed"):
        trainer(tmp_path, offline_modules=["vision"], offline_cache="read_only").train()
    trainer(tmp_path, offline_modules=["vision"]).train()
    assert not os.path.exists(tmp_path / "offline_cache" / "vision-train.partial")


def test_empty_init_module_is_read_only_to_encode(tmp_path, monkeypatch):
    tiny_model().save_pretrained(str(tmp_path / "init"))
    fills, original = [], weights.fill_module
    for user in (serve, driver):  # where modules are read: for encoding, and when prepared
        monkeypatch.setattr(user, "fill_module", lambda m, f, d, name, **k: fills.append(name) or original(m, f, d, name, **k))
    for run in ("first", "second"):
        model = Captioner.from_pretrained(str(tmp_path / "init"), empty_init=True)
        trainer(tmp_path / run, model, offline_modules=["vision"],
                offline_cache_dir=str(tmp_path / "cache")).train()
        assert all(p.is_meta for p in model.vision.parameters())
    assert fills.count("vision") == 1  # to encode once; the second run never reads it


@pytest.mark.parametrize("modules,overrides,match", [
    ({**MODULES, "vision": {}}, {}, "modules.vision.trainable: an offline module must be fully frozen"),
    (MODULES, {"offline_modules": ["audio"]}, r"offline_modules: 'audio' is not a module"),
    ({**MODULES, "projector": {"trainable": False}}, {"offline_modules": ["projector"]},
     r"modules.projector.offline_modules: Captioner declares no @offline_encoder\(module='projector'"),
])
def test_offline_arguments_are_checked_before_anything(tmp_path, modules, overrides, match):
    model = tiny_model()
    args = make_args(tmp_path, modules=modules, **{"offline_modules": ["vision"], **overrides})
    with pytest.raises(OmniArgumentError, match=match):
        OmniTrainer(model=model, args=args, train_dataset=tiny_data(model, 8))
    assert not os.path.exists(tmp_path / "offline_cache")


def test_an_iterable_dataset_is_refused(tmp_path):
    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            return iter([])

    with pytest.raises(OmniArgumentError, match="offline caches are keyed by row index and need a map-style"):
        trainer(tmp_path, data=Stream(), offline_modules=["vision"]).train()


def test_rows_without_input_store_no_feature_and_keep_their_dtype(tmp_path):
    """A text-only row (no pixel_values) stores null and reaches forward without the column; bf16 kept exactly."""
    from transformers import default_data_collator

    from hf_omni.offline.serve import CachedRows
    from hf_omni.offline.spec import offline_encoders

    model = tiny_model().to(torch.bfloat16)
    base = tiny_data(model, 6)

    class SomeTextOnly(torch.utils.data.Dataset):
        def __len__(self):
            return len(base)

        def __getitem__(self, i):
            row = dict(base[i])
            row["pixel_values"] = None if i in (1, 4) else row["pixel_values"].to(torch.bfloat16)
            return row

    data, spec = SomeTextOnly(), offline_encoders(model)["vision"]
    folder = str(tmp_path / "vision-train")
    offline_cache.write_cache(model, spec, data, folder, {"weights": "w"}, default_data_collator, 4, "cpu", None)
    cache = offline_cache.Cache(folder, len(data))
    rows = CachedRows(data, {spec: cache})
    with torch.no_grad():
        expected = model.encode_image(torch.stack([data[i]["pixel_values"] for i in (0, 5)]))
    assert cache.row(1) is None and "image_features" not in rows[4] and "pixel_values" not in rows[4]
    assert rows[0]["image_features"].dtype == torch.bfloat16
    for row, want in ((0, expected[0]), (5, expected[1])):  # each row its own feature (another batch composition)
        torch.testing.assert_close(rows[row]["image_features"], want, atol=2e-2, rtol=2e-2)
    assert not torch.allclose(rows[0]["image_features"].float(), rows[5]["image_features"].float(), atol=0.1)


def test_encode_command_builds_the_caches_and_trains_nothing(tmp_path):
    """`hf-omni encode examples/train.py config.yaml`: the run stops after its caches; a read_only run uses them."""
    import subprocess
    import sys

    import yaml

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    tiny_model().save_pretrained(str(tmp_path / "stage1"))
    config = {"init_from": str(tmp_path / "stage1"), "output_dir": str(tmp_path / "run"), "max_steps": 2,
              "per_device_train_batch_size": 8, "use_cpu": True, "report_to": "none", "save_strategy": "no",
              "disable_tqdm": True, "offline_modules": ["vision"], "modules": MODULES}
    (tmp_path / "cfg.yaml").write_text(yaml.safe_dump(config))
    command = [sys.executable, "-m", "hf_omni.cli", "encode", os.path.join(root, "examples", "train.py"),
               str(tmp_path / "cfg.yaml")]
    done = subprocess.run(command, capture_output=True, text=True, cwd=root)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "offline caches of ['vision'] ready" in done.stdout
    assert os.path.isfile(tmp_path / "run" / "offline_cache" / "vision-train" / "manifest.json")
    assert not os.path.exists(tmp_path / "run" / "config.json")  # nothing trained, nothing exported
    train = [sys.executable, os.path.join(root, "examples", "train.py"), str(tmp_path / "cfg.yaml"),
             "--offline_cache", "read_only"]
    done = subprocess.run(train, capture_output=True, text=True, cwd=root)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "held-out caption accuracy" in done.stdout and os.path.isfile(tmp_path / "run" / "config.json")


def test_encoding_writes_bounded_parts_as_it_goes(tmp_path, monkeypatch):
    """Outputs are written in parts of about `HELD` bytes as they are encoded, not held until the end: here 4 KB,
    less than one encoding batch (8 rows of 2 KB), so each of the 4 batches is a part; the cache serves the same
    rows as one written in one part."""
    small, whole = tmp_path / "small", tmp_path / "whole"
    monkeypatch.setattr(offline_cache, "HELD", 4096)
    trainer(tmp_path / "a", offline_modules=["vision"], offline_cache_dir=str(small), steps=1).train()
    monkeypatch.undo()
    trainer(tmp_path / "b", offline_modules=["vision"], offline_cache_dir=str(whole), steps=1).train()
    parts = [p for p in os.listdir(small / "vision-train") if p.startswith("part-")]
    assert len(parts) == 4 and [p for p in os.listdir(whole / "vision-train") if p.startswith("part-")] == \
        ["part-00000-00000"]
    for part in parts:
        held = sum(f.stat().st_size for f in (small / "vision-train" / part).glob("*.arrow"))
        assert held < 8 * 2048 + 4096, (part, held)  # one batch, plus Arrow's framing
    a, b = offline_cache.Cache(str(small / "vision-train"), 32), offline_cache.Cache(str(whole / "vision-train"), 32)
    assert all(torch.equal(a.row(i), b.row(i)) for i in range(32))
