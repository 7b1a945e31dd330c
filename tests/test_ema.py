"""Per-module EMA (`modules.<name>.ema`, `export_ema`; hf_omni/modules/ema.py): the update equals diffusers'
`EMAModel` (1e-6); a checkpoint resumes it bitwise (shadows and counter) and, from a 2-rank FSDP run, at 1 process;
the 2-rank run equals the 1-process one (1e-5); an export with `export_ema` writes the EMA weights and leaves the
live ones bitwise as they were; a bad field is refused naming module and key; the bytes table counts the shadows."""

from __future__ import annotations

import glob
import os

import pytest
import torch
from ema_runs import MODULES, STEPS, ema_state, prepared, run, train
from safetensors.torch import load_file

from hf_omni import OmniArgumentError, OmniPlugin, OmniTrainingArguments
from hf_omni.modules.ema import ModuleEMA
from launching import launch


@pytest.mark.parametrize("settings", [{}, {"decay": 0.9, "update_after_step": 2},
                                      {"decay": 0.999, "use_ema_warmup": True, "inv_gamma": 1.0, "power": 0.75,
                                       "min_decay": 0.1}])
def test_update_equals_diffusers_ema_model(settings):
    from diffusers.training_utils import EMAModel

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 4))
    net[1].weight.requires_grad_(False)  # a frozen parameter: no shadow here, copied (unchanged) by EMAModel
    theirs = EMAModel(net.parameters(), **settings)
    ours = ModuleEMA(net, settings)
    worst = 0.0
    for _ in range(12):
        with torch.no_grad():
            for p in net.parameters():
                if p.requires_grad:
                    p.add_(torch.randn_like(p) * 0.1)
        theirs.step(net.parameters())
        ours.update()
        assert ours.get_decay(ours.optimization_step) == theirs.cur_decay_value
        named = dict(net.named_parameters())
        for (name, p), shadow in zip(named.items(), theirs.shadow_params):
            if p.requires_grad:
                worst = max(worst, (ours.shadows[name] - shadow).abs().max().item())
    print(f"max |hf_omni - EMAModel| = {worst:.3g}")
    assert worst <= 1e-6


def test_update_reads_no_device_memory_and_skips_a_step_that_did_not_step():
    """The decay is a host number (no `.item()` of any tensor); a step skipped (fp16 inf / nan: the module not in
    `ModuleOptimizers.stepped`) is no EMA step."""
    from types import SimpleNamespace

    from hf_omni.optim.ema import attach_emas
    from hf_omni.testing.host_reads import HostReads

    net = torch.nn.Linear(4, 4)
    slot = SimpleNamespace(name="net", module=net, trains=True, args=SimpleNamespace(ema={"decay": 0.9},
                                                                                    export_ema=False))
    optimizer = SimpleNamespace(stepped={"net"}, after_step=[])
    emas = attach_emas(SimpleNamespace(slots={"net": slot}), optimizer)
    with HostReads() as reads:
        for _ in range(3):
            optimizer.after_step[0]()
    assert reads.found == [] and emas["net"].optimization_step == 3
    optimizer.stepped = set()
    before = {k: v.clone() for k, v in emas["net"].shadows.items()}
    optimizer.after_step[0]()
    assert emas["net"].optimization_step == 3 and all(torch.equal(before[k], v) for k, v in
                                                      emas["net"].shadows.items())


def test_bad_ema_field_is_refused_naming_module_and_key(tmp_path):
    with pytest.raises(OmniArgumentError, match=r"modules\.toy\.ema\.decayy"):
        OmniTrainingArguments(output_dir=str(tmp_path), use_cpu=True, modules={"toy": {"ema": {"decayy": 0.9}}})
    with pytest.raises(OmniArgumentError, match=r"ema\.decay.*\[0, 1\]"):
        OmniTrainingArguments(output_dir=str(tmp_path), use_cpu=True, ema={"decay": 2})
    from toy_runs import toy_model

    plugin = OmniPlugin(modules={"toy": {"export_ema": True}}, output_dir=str(tmp_path))
    with pytest.raises(OmniArgumentError, match=r"modules\.toy\.export_ema"):
        plugin.resolve(toy_model())


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("ema_single"))
    return out, run(out)


def _equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _ema_equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(a[n]["step"] == b[n]["step"] and _equal(a[n]["shadows"], b[n]["shadows"])
                                        for n in a)


def test_resume_is_bitwise_with_the_ema(single):
    _, r = single
    assert {n: e["step"] for n, e in r["ema"].items()} == {"toy": STEPS, "llm": STEPS}
    assert _ema_equal(r["ema_loaded"], r["ema_at_save"])
    assert r["resumed_losses"] == r["losses"][2:]
    assert _equal(r["resumed_live"], r["live"])
    assert _ema_equal(r["resumed_ema"], r["ema"])
    assert not _equal(r["ema"]["toy"]["shadows"], {k[4:]: v for k, v in r["live"].items()
                                                   if k[4:] in r["ema"]["toy"]["shadows"]})


def test_export_ema_writes_the_ema_weights_and_restores_the_live_ones(single):
    out, r = single
    assert _equal(r["restored"], r["live"])  # swapped back bitwise
    written = load_file(os.path.join(out, "export", "toy", "toy_weights.safetensors"))
    shadows = r["ema"]["toy"]["shadows"]
    assert all(torch.equal(written[k], shadows[k]) for k in shadows)
    assert torch.equal(written["scale"], r["live"]["toy.scale"])  # a buffer: as it is
    llm = {}  # no export_ema: the live weights
    for path in glob.glob(os.path.join(out, "export", "llm", "*.safetensors")):
        llm.update(load_file(path))
    assert all(torch.equal(v, r["live"]["llm." + k]) for k, v in llm.items())
    assert _equal(r["llm_swapped"], {f"llm.{k}": v for k, v in r["ema"]["llm"]["shadows"].items()})


def test_bytes_table_counts_the_shadows(single):
    _, r = single
    model = prepared("unused", MODULES)[0]
    for name in ("toy", "llm"):
        params = [p for p in model.slots[name].module.parameters() if p.requires_grad]
        assert r["bytes"][name] == sum(p.numel() * p.element_size() for p in params) > 0


def test_checkpoint_without_ema_and_ema_without_run(single, tmp_path):
    out, _ = single
    plain = {"toy": {"learning_rate": 1e-2}, "llm": {"learning_rate": 1e-3}}
    model, plugin, accelerator = prepared(str(tmp_path / "plain"), plain)
    train(model, plugin, accelerator, 4, range(1))
    plugin.save_state(str(tmp_path / "plain-ckpt"), step=1)
    plugin.wait_for_save()
    assert not os.path.exists(tmp_path / "plain-ckpt" / "toy" / "state" / "ema.json")
    again, plugin2, _ = prepared(str(tmp_path / "again"), MODULES)
    plugin2.load_state(str(tmp_path / "plain-ckpt"))  # EMA starts from the resumed weights, counter 0
    for name, state in ema_state(again).items():
        assert state["step"] == 0
        live = dict(again.slots[name].module.named_parameters())
        assert all(torch.equal(s, live[k].detach()) for k, s in state["shadows"].items())
    best, plugin4, _ = prepared(str(tmp_path / "best"), MODULES)  # load_best_model_at_end: the checkpoint's EMA
    plugin4.load_state(os.path.join(out, "checkpoint-2"), weights_only=True)
    assert _ema_equal(ema_state(best), single[1]["ema_at_save"])
    without, plugin3, _ = prepared(str(tmp_path / "without"), plain)
    plugin3.load_state(os.path.join(out, "checkpoint-2"))  # its EMA is not read
    assert all(slot.ema is None for slot in without.slots.values())


def test_a_resume_reads_each_module_state_metadata_once(single, tmp_path, monkeypatch):
    """DCP's metadata of each module's `state/` (all its shard headers) is read once a resume, for the optimizer
    state and the EMA shadows alike (before: once each); a weights-only load (the best model's EMA) reads it once."""
    from helpers import count_metadata_reads

    out, _ = single
    for weights_only in (False, True):
        again, plugin, _ = prepared(str(tmp_path / f"again-{weights_only}"), MODULES)
        reads = count_metadata_reads(monkeypatch, os.path.join(out, "checkpoint-2"))
        plugin.load_state(os.path.join(out, "checkpoint-2"), weights_only=weights_only)
        assert reads == {"toy/state": 1, "llm/state": 1}, weights_only
        assert _ema_equal(ema_state(again), single[1]["ema_at_save"])


def test_two_ranks_fsdp_equal_one_process_and_resume_at_one(single, tmp_path):
    _, r1 = single
    launch("mp_ema.py", str(tmp_path))
    r2 = torch.load(tmp_path / "result.pt", weights_only=False)
    assert all(r2["dtensor_shadows"].values()) and r2["dtensor_shadows"]  # sharded like the parameters
    for key in ("live", "resumed_live"):
        torch.testing.assert_close(r2[key], r1[key], atol=1e-5, rtol=0)
    for key in ("ema", "ema_at_save", "resumed_ema"):
        for name in r1[key]:
            assert r2[key][name]["step"] == r1[key][name]["step"]
            torch.testing.assert_close(r2[key][name]["shadows"], r1[key][name]["shadows"], atol=1e-5, rtol=0)
    assert r2["bytes"]["toy"] * 2 == r1["bytes"]["toy"]  # each rank its shard (the toy's sizes split evenly)
    assert _equal(r2["restored"], r2["live"])  # the 2-rank export swapped the sharded toy back bitwise
    written = load_file(str(tmp_path / "export" / "toy" / "toy_weights.safetensors"))
    assert all(torch.equal(written[k], v) for k, v in r2["ema"]["toy"]["shadows"].items())
    model, plugin, accelerator = prepared(str(tmp_path / "elastic"), MODULES)  # the 2-rank checkpoint at 1 process
    plugin.load_state(str(tmp_path / "checkpoint-2"))
    assert _ema_equal(ema_state(model), r2["ema_at_save"])
    train(model, plugin, accelerator, 4, range(2, STEPS))
    for name, state in ema_state(model).items():
        torch.testing.assert_close(state["shadows"], r2["ema"][name]["shadows"], atol=1e-5, rtol=0)


def test_cli_export_of_a_checkpoint_writes_the_ema_weights(single, tmp_path):
    from hf_omni.cli import export

    out, r = single
    export(os.path.join(out, "checkpoint-2"), str(tmp_path / "exported"))
    written = load_file(str(tmp_path / "exported" / "toy" / "toy_weights.safetensors"))
    shadows = r["ema_at_save"]["toy"]["shadows"]
    assert all(torch.equal(written[k], shadows[k]) for k in shadows)
    llm = load_file(os.path.join(out, "checkpoint-2", "llm", "model.safetensors"))  # no export_ema: as saved
    exported = load_file(str(tmp_path / "exported" / "llm" / "model.safetensors"))
    assert all(torch.equal(exported[k], v) for k, v in llm.items())


def test_lora_unet_ema_samples_and_exports_with_the_ema_weights(tmp_path):
    """A diffusers module with LoRA under OmniTrainer: the EMA covers the adapters alone (the trained parameters);
    `to_pipeline()` samples and `save_model` exports (LoRA merged, and diffusers' LoRA file) with the EMA weights, as
    the same calls inside `ema_weights` without `export_ema` do; the live weights are bitwise as before after."""
    from diffusion_runs import LORA, trainer
    from tiny_pipelines import sample

    from hf_omni import ema_weights

    lora = {**LORA, "target_modules": ["to_q", "to_k", "to_v", "to_out.0"]}
    modules = {"unet": {"learning_rate": 1e-2, "lora": lora, "ema": {"decay": 0.5}, "export_ema": True},
               "text_encoder": {"trainable": False}, "vae": {"trainable": False}}
    run = trainer("sd", str(tmp_path / "run"), modules, 4, max_steps=2)  # checkpoint-2: the final state
    run.train()
    model, ema = run.model, run.model.slots["unet"].ema
    assert ema.optimization_step == 2 and ema.shadows and all("lora_" in name for name in ema.shadows)
    live = {k: v.detach().clone() for k, v in model.unet.state_dict().items()}
    with_ema = sample(model.to_pipeline())
    run.save_model(str(tmp_path / "export"))
    assert all(torch.equal(v, live[k]) for k, v in model.unet.state_dict().items())  # swapped back bitwise
    ema.export = False
    plain = sample(model.to_pipeline())
    with ema_weights(model, modules=["unet"]):
        by_hand = sample(model.to_pipeline())
        model.save_pretrained(str(tmp_path / "by_hand"))
    assert torch.equal(with_ema, by_hand) and not torch.equal(with_ema, plain)
    from hf_omni.cli import main

    main(["export", str(tmp_path / "run" / "checkpoint-2"), str(tmp_path / "cli")])  # EMA read from state/
    for name in ("unet/diffusion_pytorch_model.safetensors", "pytorch_lora_weights.safetensors"):
        theirs = load_file(str(tmp_path / "by_hand" / name))
        for folder in ("export", "cli"):
            ours = load_file(str(tmp_path / folder / name))
            assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours), (folder, name)


def test_adopted_part_ema_resumes_and_exports_in_the_released_format(tmp_path):
    """An adopted model's projector (a part of a released model) with EMA: `save_model` and `hf-omni export` of a
    checkpoint write its EMA weights under the released class's keys; a resume restores the EMA bitwise."""
    from helpers import make_args
    from released_models import BUILDERS, MODULES, Rows, collate

    from hf_omni import OmniModel, OmniTrainer
    from hf_omni.cli import main

    family = next(iter(BUILDERS))
    names = MODULES[family]
    settings = {"vision": {"trainable": False}, "llm": {"trainable": False},
                "projector": {"learning_rate": 1e-2, "ema": {"decay": 0.7}, "export_ema": True}}
    projector = "projector"

    def trainer(out):
        model = OmniModel.from_model(BUILDERS[family](0), modules=names)
        return OmniTrainer(model=model, args=make_args(out, modules=settings, save_strategy="steps", save_steps=2),
                           train_dataset=Rows(family, model.released, 32), data_collator=collate)

    straight = trainer(tmp_path / "straight")
    straight.train()
    ema = straight.model.slots[projector].ema
    straight.save_model(str(tmp_path / "export"))
    main(["export", str(tmp_path / "straight" / "checkpoint-4"), str(tmp_path / "cli")])
    for folder in ("export", "cli"):
        written = load_file(str(tmp_path / folder / "model.safetensors"))
        keyed = {k: next(w for w in written if k.endswith(w)) for k in ema.shadows}  # the released class's keys
        assert all(torch.equal(written[keyed[k]], s) for k, s in ema.shadows.items()), folder
    resumed = trainer(tmp_path / "resumed")
    resumed.train(resume_from_checkpoint=str(tmp_path / "straight" / "checkpoint-2"))
    again = resumed.model.slots[projector].ema
    assert again.optimization_step == ema.optimization_step == 4
    assert all(torch.equal(again.shadows[k], s) for k, s in ema.shadows.items())
    a, b = straight.model.state_dict(), resumed.model.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
