"""Diffusers models as modules and diffusers pipelines as composed models (tests/diffusion_runs.py over the tiny
offline pipelines of tests/tiny_pipelines.py): OmniTrainer equals the hand-written loop shaped like diffusers'
training scripts at 1 process and at 2 ranks (denoiser FSDP, text encoder DDP or frozen), resumes bitwise and at
another world size, and writes pipeline folders that diffusers loads by the pipeline class alone (LoRA merged, and
in diffusers' LoRA file for `load_lora_weights`)."""

import json
import os
import subprocess
import sys

import pytest
import torch
from diffusers import AutoencoderKL, FluxPipeline, StableDiffusionPipeline, UNet2DConditionModel, WanPipeline
from diffusion_runs import FLUX, SD, WAN_SP, model, pipeline_state, reference, run, trainer
from helpers import assert_state_close, full_state, step_losses
from launching import launch, subprocess_env
from tiny_pipelines import flux_pipeline, sample, sd_pipeline, wan_pipeline

import hf_omni
from hf_omni import OmniArgumentError, OmniModel, SampleImagesCallback
from hf_omni.cli import export
from hf_omni.files.format import format_of

PIPELINES = {"sd": StableDiffusionPipeline, "flux": FluxPipeline, "wan": WanPipeline}


def test_a_diffusers_model_is_a_module(tmp_path):
    """A UNet composed alone: its folder is diffusers' own (sharded with its index when large), loadable by its
    class alone; the composition rebuilds it eagerly and on the meta device."""
    unet = sd_pipeline().unet
    composed = OmniModel.from_modules({"unet": unet})
    assert format_of(unet).name == "diffusers" and composed.config.modules[0].cls == "diffusers.UNet2DConditionModel"
    composed.save_pretrained(tmp_path / "one")
    composed.save_pretrained(tmp_path / "sharded", max_shard_size=20_000)
    assert sorted(os.listdir(tmp_path / "one" / "unet")) == ["config.json", "diffusion_pytorch_model.safetensors"]
    files = os.listdir(tmp_path / "sharded" / "unet")
    assert "diffusion_pytorch_model.safetensors.index.json" in files and len(files) > 3
    for folder in ("one", "sharded"):
        alone = UNet2DConditionModel.from_pretrained(tmp_path / folder / "unet")
        assert all(torch.equal(alone.state_dict()[k], v) for k, v in unet.state_dict().items())
        assert json.loads((tmp_path / folder / "unet" / "config.json").read_text())["_class_name"] == \
            "UNet2DConditionModel"
    eager = OmniModel.from_pretrained(tmp_path / "sharded")
    assert type(eager.unet) is UNet2DConditionModel and not eager.unet.training
    assert all(torch.equal(eager.unet.state_dict()[k], v) for k, v in unet.state_dict().items())
    fmt = format_of(unet)
    assert "model = UNet2DConditionModel.from_pretrained(\"org/x\", subfolder=\"unet\")" in fmt.card_usage(
        "diffusers.UNet2DConditionModel", "org/x", "unet")
    assert fmt.rebuild_difference(UNet2DConditionModel, str(tmp_path / "one" / "unet"),
                                  str(tmp_path / "sharded" / "unet")) is None
    other = tmp_path / "other"
    changed = {k: v for k, v in unet.config.items() if not k.startswith("_")}  # `_use_default_values` would win
    UNet2DConditionModel.from_config({**changed, "norm_eps": 1e-6}).save_pretrained(other)
    assert fmt.rebuild_difference(UNet2DConditionModel, str(tmp_path / "one" / "unet"), str(other)) == \
        "config: norm_eps"
    empty = OmniModel.from_pretrained(tmp_path / "one", empty_init=True)
    assert all(p.is_meta for p in empty.unet.parameters())
    assert empty.unet.config["_name_or_path"] == str(tmp_path / "one" / "unet")


def test_empty_init_reads_a_bf16_folder_as_diffusers_loads_it(tmp_path):
    """diffusers' `from_pretrained` builds in float32 and casts a bf16 file's tensors up (its dtype not asked):
    `empty_init`, sharded, reads each rank's rows the same way; `activation_checkpointing` goes through diffusers'
    own `enable_gradient_checkpointing` and changes no number."""
    sd_pipeline().unet.to(torch.bfloat16).save_pretrained(tmp_path / "unet")
    expected = UNet2DConditionModel.from_pretrained(tmp_path / "unet").state_dict()
    composed = OmniModel.from_modules({"unet": UNet2DConditionModel.from_pretrained(tmp_path / "unet")})
    composed.save_pretrained(tmp_path / "composed")
    empty = OmniModel.from_pretrained(tmp_path / "composed", empty_init=True)
    from accelerate import Accelerator

    hf_omni.OmniPlugin(modules={"unet": {"parallel": "fsdp"}}, defaults={}).prepare_modules(Accelerator(cpu=True),
                                                                                            empty)
    state = full_state(empty)
    assert all(v.dtype == torch.float32 for v in state.values())
    assert all(torch.equal(state["unet." + k], v) for k, v in expected.items())
    plain, checkpointed = (trainer("sd", str(tmp_path / name), modules, batch=4, max_steps=2)
                           for name, modules in (("plain", SD), ("checkpointed", {
                               **SD, "unet": {**SD["unet"], "activation_checkpointing": True}})))
    plain.train()
    checkpointed.train()
    assert any(getattr(m, "gradient_checkpointing", False) for m in checkpointed.model.unet.modules())
    assert step_losses(checkpointed) == step_losses(plain)
    assert all(torch.equal(v, full_state(plain.model)[k]) for k, v in full_state(checkpointed.model).items())


def test_a_pipeline_is_adopted_and_saved_back_as_a_pipeline(tmp_path):
    pipe = sd_pipeline()
    expected = sample(pipe)
    composed = model("sd")
    assert composed.module_names == ["vae", "text_encoder", "unet"]
    assert sorted(composed.pipeline_parts) == ["scheduler", "tokenizer"] and composed.scheduler is not None
    assert list(composed.processors) == ["text_encoder"]
    assert torch.equal(sample(composed.to_pipeline()), expected)
    composed.save_pretrained(tmp_path / "out")
    assert {"model_index.json", "scheduler", "tokenizer", "unet", "vae", "text_encoder"} <= set(
        os.listdir(tmp_path / "out")) and "PIPELINE.md" not in os.listdir(tmp_path / "out")
    assert torch.allclose(sample(StableDiffusionPipeline.from_pretrained(tmp_path / "out")), expected, atol=1e-5)
    again = type(composed).from_pretrained(tmp_path / "out")
    assert torch.allclose(sample(again.to_pipeline()), expected, atol=1e-5)
    by_path = type(composed).from_pipeline(StableDiffusionPipeline, str(tmp_path / "out"))
    assert torch.allclose(sample(by_path.to_pipeline()), expected, atol=1e-5)
    empty = type(composed).from_pipeline(StableDiffusionPipeline, str(tmp_path / "out"), empty_init=True)
    assert all(p.is_meta for m in empty.omni_modules().values() for p in m.parameters())
    assert [e.source for e in empty.config.modules] == [str(tmp_path / "out" / n) for n in empty.module_names]
    without = type(composed).from_pipeline(StableDiffusionPipeline, str(tmp_path / "out"), empty_init=True,
                                           text_encoder=None)  # left out, as `safety_checker=None` is
    assert without.module_names == ["unet", "vae"] and without.config.pipeline["text_encoder"] == [None, None]
    with pytest.raises(TypeError, match=r"takes no \['dtype'\]"):
        type(composed).from_pipeline(StableDiffusionPipeline, str(tmp_path / "out"), empty_init=True, dtype="x")
    crafted = json.loads((tmp_path / "out" / "config.json").read_text())  # a downloaded config naming other code
    for library in ("os", "../x"):
        crafted["pipeline"]["scheduler"] = [library, "system"]
        (tmp_path / "out" / "config.json").write_text(json.dumps(crafted))
        with pytest.raises(ValueError, match=r"pipeline component 'scheduler': (class os.system was not found|"
                                             r"library '../x' is not transformers)"):
            type(composed).from_pretrained(tmp_path / "out")
    with pytest.raises(TypeError, match="takes a pipeline instance alone"):
        OmniModel.from_pipeline(pipe, "somewhere")
    with pytest.raises(ValueError, match="expected a diffusers pipeline"):
        OmniModel.from_pipeline(pipe.unet)
    with pytest.raises(ValueError, match="not adopted from a pipeline"):
        OmniModel.from_modules({"unet": pipe.unet}).to_pipeline()


@pytest.mark.parametrize("empty_init", [False, True], ids=["eager", "empty_init"])
def test_a_damaged_pipeline_folder_is_named_before_anything_is_built(tmp_path, empty_init):
    """A truncated `model_index.json`, one without its class, a component folder missing or without its config: one
    clear error naming the file or the component's folder, eager or `empty_init`, nothing written."""
    import shutil

    from hf_omni.core.errors import DamagedFileError

    sd_pipeline().save_pretrained(tmp_path / "good")
    index = (tmp_path / "good" / "model_index.json").read_text()
    cases = {
        "truncated index": (lambda f: (f / "model_index.json").write_text(index[:len(index) // 2]),
                            DamagedFileError, r"model_index\.json is not valid JSON"),
        "index without its class": (lambda f: (f / "model_index.json").write_text(json.dumps({"unet": ["a", "b"]})),
                                    DamagedFileError, r"model_index\.json is not a pipeline's model_index\.json"),
        "no index": (lambda f: (f / "model_index.json").unlink(), FileNotFoundError, r"has no model_index\.json"),
        "missing unet": (lambda f: shutil.rmtree(f / "unet"), FileNotFoundError,
                         r"pipeline component 'unet': .*unet is missing or empty"),
        "unet without config": (lambda f: (f / "unet" / "config.json").unlink(), FileNotFoundError,
                                r"pipeline component 'unet': .*unet has no config\.json"),
    }
    for name, (damage, error, match) in cases.items():
        folder = tmp_path / name.replace(" ", "_")
        shutil.copytree(tmp_path / "good", folder)
        damage(folder)
        before = sorted(p.name for p in folder.rglob("*"))
        with pytest.raises(error, match=match):
            OmniModel.from_pipeline(StableDiffusionPipeline, str(folder), empty_init=empty_init)
        assert sorted(p.name for p in folder.rglob("*")) == before, name


def test_sd_trains_as_the_diffusers_loop_resumes_and_exports(tmp_path):
    ref_losses, ref_pipe = reference("sd")
    result = run("sd", str(tmp_path), SD, batch=4)
    assert result["losses"] == pytest.approx(ref_losses, abs=1e-5)
    assert_state_close(result["state"], pipeline_state(ref_pipe), atol=1e-5)
    assert result["resumed_losses"] == result["losses"][-2:]  # bitwise
    assert all(torch.equal(result["resumed_state"][k], v) for k, v in result["state"].items())
    checkpoint = tmp_path / "run" / "checkpoint-2"
    assert "PIPELINE.md" in os.listdir(checkpoint) and "model_index.json" not in os.listdir(checkpoint)
    exported = sample(StableDiffusionPipeline.from_pretrained(tmp_path / "export"))
    assert torch.allclose(exported, result["sample"], atol=1e-5) and torch.allclose(exported, sample(ref_pipe),
                                                                                     atol=1e-5)
    export(str(tmp_path / "run" / "checkpoint-4"), str(tmp_path / "cli"))
    assert torch.allclose(sample(StableDiffusionPipeline.from_pretrained(tmp_path / "cli")), sample(ref_pipe),
                          atol=1e-5)


def test_flux_trains_as_the_diffusers_loop_and_logs_samples(tmp_path):
    """The transformer trained (both text encoders and the VAE frozen), sample images logged every 2 steps: the
    losses are the loop's (sampling leaves training's random state alone), the last images the model's."""
    ref_losses, ref_pipe = reference("flux")
    callback = SampleImagesCallback(["a cat"], every_n_steps=2, height=16, width=16, max_sequence_length=16)
    run_ = trainer("flux", str(tmp_path / "run"), FLUX, batch=4, report_to=["tensorboard"], save_strategy="no")
    run_.add_callback(callback)
    run_.train()
    assert step_losses(run_) == pytest.approx(ref_losses, abs=1e-5)
    assert_state_close(full_state(run_.model), pipeline_state(ref_pipe), atol=1e-5)
    assert sorted(os.listdir(tmp_path / "run" / "samples")) == ["step-2", "step-4"]
    from PIL import Image

    logged = torch.tensor(list(Image.open(tmp_path / "run" / "samples" / "step-4" / "0.png").getdata()))
    expected = (sample(ref_pipe).permute(0, 2, 3, 1).reshape(-1, 3) * 255).round()
    assert (logged.float() - expected).abs().max() <= 1
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "run" / "runs" / "samples"), size_guidance={"images": 0})
    events.Reload()
    assert [e.step for e in events.Images("samples")] == [2, 4]


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    """tests/scripts/mp_diffusion.py's scenarios, one launch at 2 ranks: the folder of their results."""
    out = tmp_path_factory.mktemp("mp_diffusion")
    launch("mp_diffusion.py", str(out))
    return out


def test_two_ranks_equal_the_loop_resume_at_one_process_and_export_lora(two_ranks, tmp_path):
    """At 2 ranks (batch 2 each): SD (UNet FSDP, text encoder DDP at its own learning rate) and Flux (transformer
    FSDP) equal the loop; SD's 2-rank checkpoint resumes at 1 process; Flux with LoRA on the sharded transformer
    and the replicated CLIP encoder exports a merged pipeline and diffusers' LoRA file that load alike."""
    for kind in ("sd", "flux"):
        ref_losses, ref_pipe = reference(kind)
        result = torch.load(two_ranks / f"{kind}.pt", weights_only=False)
        assert result["losses"] == pytest.approx(ref_losses, abs=1e-5), kind
        # Adam moves a weight by up to lr per step whatever its gradient's size: where a gradient is ~0, the other
        # summation order of two ranks moves it differently (seen: one UNet element 1.2e-5 off, the rest < 3e-6)
        assert_state_close(result["state"], pipeline_state(ref_pipe), atol=0.05 * 1e-3)
        exported = sample(PIPELINES[kind].from_pretrained(two_ranks / kind / "export"))
        assert torch.allclose(exported, result["sample"], atol=1e-5) and torch.allclose(exported, sample(ref_pipe),
                                                                                         atol=1e-5)
    sd, flux = (torch.load(two_ranks / f"{kind}.pt", weights_only=False) for kind in ("sd", "flux"))
    # FSDP units: the denoiser's blocks (its `_no_split_modules`) and itself; the replicated encoder none
    assert sd["units"]["unet"] == ["BasicTransformerBlock", "CrossAttnUpBlock2D", "ResnetBlock2D",
                                   "UNet2DConditionModel", "UpBlock2D"] and sd["units"]["text_encoder"] == []
    assert flux["units"]["transformer"] == ["FluxSingleTransformerBlock", "FluxTransformer2DModel",
                                            "FluxTransformerBlock"]
    assert sd["resumed_losses"] == sd["losses"][-2:]
    assert all(torch.equal(sd["resumed_state"][k], v) for k, v in sd["state"].items())
    elastic = trainer("sd", str(tmp_path / "elastic"), SD, batch=4)  # the 2-rank checkpoint at 1 process
    elastic.train(resume_from_checkpoint=str(two_ranks / "sd" / "run" / "checkpoint-2"))
    assert step_losses(elastic)[-2:] == pytest.approx(sd["losses"][-2:], abs=1e-5)
    assert_state_close(full_state(elastic.model), sd["state"], atol=1e-5)

    lora = torch.load(two_ranks / "flux_lora.pt", weights_only=False)
    assert lora["resumed_losses"] == lora["losses"][-2:]  # the adapters and their optimizer state come back
    assert all(torch.equal(lora["resumed_state"][k], v) for k, v in lora["state"].items())
    assert any(".lora_A." in k for k in lora["state"])
    lora_export = two_ranks / "flux_lora" / "export"
    merged = sample(FluxPipeline.from_pretrained(lora_export))
    base = flux_pipeline()
    before = sample(base)
    base.load_lora_weights(lora_export)
    assert torch.allclose(sample(base), merged, atol=1e-4)
    assert (merged - before).abs().max() > 1e-3  # the adapters trained


def test_video_transformer_sequence_parallel_over_two_ranks_equals_the_loop(two_ranks, tmp_path):
    """Wan at 2 ranks (batch 2 each): its video transformer's sequence split over both (diffusers' own Ulysses
    attention, enabled behind hf_omni.compat) and its weights sharded over them, the T5 encoder and the VAE frozen.
    Losses, weights and samples as the loop at 1 process on the same global batch; each rank's second block runs on
    half of the 12 tokens of the group's rows; resumed bitwise; its checkpoint resumes at 1 process without sequence
    parallelism; the export loads by WanPipeline alone and samples alike."""
    ref_losses, ref_pipe = reference("wan")
    got = torch.load(two_ranks / "wan_sp2.pt", weights_only=False)
    assert got["losses"] == pytest.approx(ref_losses, rel=1e-5)
    assert_state_close(got["state"], pipeline_state(ref_pipe), atol=1e-5)
    assert got["units"]["transformer"] == ["WanTransformer3DModel", "WanTransformerBlock"]
    # sampling: the pipeline's own calls (with and without the prompt) run the group's rows, 6 of 12 tokens a rank
    assert got["tokens"] and {shape[1] for shape in got["tokens"]} == {6}
    assert torch.allclose(got["sample"], sample(ref_pipe), atol=1e-5)
    assert got["resumed_losses"] == got["losses"][-2:]
    assert all(torch.equal(got["resumed_state"][k], v) for k, v in got["state"].items())
    exported = sample(WanPipeline.from_pretrained(two_ranks / "wan_sp2" / "export"))
    assert torch.allclose(exported, got["sample"], atol=1e-5)
    one = {**WAN_SP, "transformer": {"learning_rate": 1e-3, "parallel": "fsdp"}}  # the same run at 1 process
    elastic = trainer("wan", str(tmp_path / "elastic"), one, batch=4)
    elastic.train(resume_from_checkpoint=str(two_ranks / "wan_sp2" / "run" / "checkpoint-2"))
    assert step_losses(elastic)[-2:] == pytest.approx(got["losses"][-2:], rel=1e-5)
    assert_state_close(full_state(elastic.model), got["state"], atol=1e-5)


def test_video_sequence_boundary_on_ragged_rows_and_a_length_it_cannot_split(two_ranks):
    """The boundary alone at sp 2 (tests/scripts/mp_diffusion.py `wan_ragged`): rank r runs r + 1 rows of its own;
    its outputs, every weight's gradient (summed over the ranks, as FSDP2's reduction does) and the gradients of its
    latents and text states as one process's on every rank's rows; 3 tokens on 2 ranks refused on both by name."""
    got = torch.load(two_ranks / "wan_ragged.pt", weights_only=False)
    for rank, r in enumerate(got):
        assert r["shape"] == (rank + 1, 16, 3, 4, 4) and r["tokens"] == (3, 6, 24)  # the group's 3 rows, 6 tokens
        assert r["output"] < 1e-5 and r["params"] < 1e-6 * r["grad_scale"] / 0.1  # summed partial gradients
        assert r["latents"] < 1e-7 and r["text"] < 1e-7  # each rank's inputs: the group's gradients summed back
        assert r["refused"].startswith("modules.transformer.parallelism.sp_size: its sequence at rope's output 0 "
                                       "has 3 tokens, which 2 ranks cannot split evenly")


def test_sequence_parallel_diffusers_models_are_checked_by_name():
    """Heads that sp does not divide, an attention backend diffusers serves no context parallelism on, and a model
    without a context-parallel plan (a UNet): refused by module and key before anything is split."""
    from hf_omni.parallel.layout import layouts_for

    wan = wan_pipeline().transformer  # 2 heads
    with pytest.raises(OmniArgumentError, match=r"transformer.*parallelism\.sp_size.*2 attention heads.*Ulysses"):
        layouts_for("transformer", {"sp_size": 4})[0].check(wan)
    layouts_for("transformer", {"sp_size": 2})[0].check(wan)
    wan.set_attention_backend("_native_math")
    with pytest.raises(OmniArgumentError, match=r"transformer.*sp_size.*`_native_math` backend, on which diffusers "
                                                r"serves no context parallelism"):
        layouts_for("transformer", {"sp_size": 2})[0].check(wan)
    with pytest.raises(OmniArgumentError, match=r"unet.*sp_size.*UNet2DConditionModel's attention is reached "
                                                r"neither through transformers' attention interface nor through "
                                                r"diffusers' context-parallel plan"):
        layouts_for("unet", {"sp_size": 2})[0].check(sd_pipeline().unet)


def test_lora_outside_the_pipelines_lora_file_is_refused_before_compute(tmp_path):
    modules = {**SD, "vae": {"learning_rate": 1e-3, "lora": {"r": 2, "target_modules": ["conv1"]}}}
    with pytest.raises(OmniArgumentError, match=r"modules.vae.lora: StableDiffusionPipeline holds LoRA of "
                                                r"\['unet', 'text_encoder'\] only"):
        trainer("sd", str(tmp_path), modules, batch=4).train()
    assert not os.path.exists(tmp_path / "checkpoint-2")


BLOCKED = """
import sys
sys.modules["diffusers"] = None  # as if not installed
import torch, hf_omni
from transformers import LlamaConfig, LlamaForCausalLM
llm = LlamaForCausalLM(LlamaConfig(hidden_size=8, intermediate_size=8, num_hidden_layers=1, num_attention_heads=2,
                                   num_key_value_heads=2, vocab_size=16))
composed = hf_omni.OmniModel.from_modules({"llm": llm})
composed.save_pretrained(sys.argv[1] + "/llm")
hf_omni.OmniModel.from_pretrained(sys.argv[1] + "/llm")
try:
    hf_omni.OmniModel.from_pretrained(sys.argv[1] + "/pipeline")
except ImportError as err:
    print("REFUSED:", err)
"""


def test_without_diffusers_everything_else_works_and_a_diffusers_module_names_the_extra(tmp_path):
    model("sd").save_pretrained(tmp_path / "pipeline")
    out = subprocess.run([sys.executable, "-c", BLOCKED, str(tmp_path)], capture_output=True, text=True,
                         env=subprocess_env(), timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "REFUSED: diffusers is not installed: pip install 'hf_omni[diffusion]'" in out.stdout
    assert "diffusers.AutoencoderKL" in out.stdout
    assert "SampleImagesCallback" in hf_omni.__all__ and AutoencoderKL is not None
