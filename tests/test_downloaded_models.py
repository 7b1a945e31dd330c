"""What `from_pretrained` does for the models people download, done by `empty_init` too (docs/from_pretrained.md):
tied weights stay one parameter, `_keep_in_fp32_modules` (fp16 loads) and `_keep_in_fp32_modules_strict` (bf16 too)
stay in float32, the folder's generation config is read; each against transformers' own `from_pretrained` of the
same folder. And what composition refuses: a tensor in two modules, a class an export cannot be built back as."""

import pytest
import torch
from helpers import Captioner, make_args, tiny_data, tiny_model
from transformers import (
    DeepseekV3Config, DeepseekV3ForCausalLM, GenerationConfig, LlamaConfig, LlamaForCausalLM, T5Config, T5EncoderModel,
    ViTConfig, ViTModel,
)

from hf_omni import OmniModel, OmniPlugin, OmniTrainer, Projector, ProjectorConfig, register_module_class
from hf_omni.formats.transformers_classes import REGISTERED


class Single(OmniModel):
    """One module to compare with its own `from_pretrained`; the projector only makes it a composition."""

    def forward(self, **inputs):
        return self.main(**inputs)


def compose(module, folder):
    projector = Projector(ProjectorConfig(in_features=4, out_features=4))
    Single.from_modules({"main": module, "projector": projector}).save_pretrained(folder)


def filled(folder):
    """The composition rebuilt with empty_init and prepared (filled) by the plugin, as training would."""
    from accelerate import Accelerator

    model = Single.from_pretrained(folder, empty_init=True)
    assert all(p.is_meta for p in model.main.parameters())
    plugin = OmniPlugin(modules={"main": {"trainable": False}}, defaults={}, output_dir=str(folder))
    plugin.prepare_modules(Accelerator(cpu=True), model)  # (after the arguments, which reset Accelerate's state)
    return model.main


def dtypes(module) -> dict:
    return {n: t.dtype for n, t in list(module.named_parameters()) + list(module.named_buffers())}


T5 = dict(vocab_size=32, d_model=16, d_kv=8, d_ff=16, num_layers=2, num_heads=2)
DEEPSEEK = dict(vocab_size=32, hidden_size=16, intermediate_size=16, moe_intermediate_size=8, num_hidden_layers=2,
                first_k_dense_replace=1, num_attention_heads=2, num_key_value_heads=2, n_routed_experts=4,
                num_experts_per_tok=2, n_group=1, topk_group=1, kv_lora_rank=8, q_lora_rank=8, qk_rope_head_dim=4,
                qk_nope_head_dim=4, v_head_dim=4, n_shared_experts=1)


@pytest.mark.parametrize("kind", ["t5_fp16", "deepseek_bf16"])
def test_keep_in_fp32_modules_as_from_pretrained(tmp_path, kind):
    """T5's `wo` (`_keep_in_fp32_modules`) loads in fp32 from fp16 files; DeepSeek-V3's router bias
    (`_keep_in_fp32_modules_strict`; its weight too from transformers 5.25) from bf16 files too. The empty_init build has the same dtype for every tensor
    and the same outputs."""
    torch.manual_seed(0)
    if kind == "t5_fp16":
        module, dtype = T5EncoderModel(T5Config(**T5)), torch.float16
        inputs = {"input_ids": torch.randint(0, 32, (2, 5))}
    else:
        module, dtype = DeepseekV3ForCausalLM(DeepseekV3Config(**DEEPSEEK)), torch.bfloat16
        inputs = {"input_ids": torch.randint(0, 32, (2, 5))}
    compose(module.to(dtype), tmp_path)
    reference = type(module).from_pretrained(tmp_path / "main")
    kept = {n for n, d in dtypes(reference).items() if d == torch.float32 and "inv_freq" not in n}
    router = ".mlp.gate."  # the router's bias (and, from transformers 5.25, its weight) kept in fp32
    assert kept and all(("wo" in n) if kind == "t5_fp16" else (router in n) for n in kept), kept
    ours = filled(tmp_path)
    assert dtypes(ours) == dtypes(reference)
    with torch.no_grad():
        mine, theirs = ours.eval()(**inputs), reference(**inputs)
    out = "last_hidden_state" if kind == "t5_fp16" else "logits"
    assert torch.equal(getattr(mine, out), getattr(theirs, out))


def test_tied_weights_stay_one_parameter(tmp_path):
    """A Llama with tied embeddings: the file holds one tensor; empty_init keeps lm_head and embed_tokens one
    parameter (not a fresh random lm_head) and gives the eager build's logits."""
    torch.manual_seed(0)
    llm = LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=16, num_hidden_layers=1,
                                       num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True))
    compose(llm, tmp_path)
    ours = filled(tmp_path)
    assert ours.lm_head.weight is ours.model.embed_tokens.weight
    ids = torch.randint(0, 32, (2, 5))
    with torch.no_grad():
        assert torch.equal(ours(input_ids=ids).logits, llm.eval()(input_ids=ids).logits)


def test_generation_config_is_read_from_the_folder(tmp_path):
    llm = LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=16, num_hidden_layers=1,
                                       num_attention_heads=2, num_key_value_heads=1))
    llm.generation_config = GenerationConfig(max_new_tokens=7, do_sample=True, top_k=3)
    compose(llm, tmp_path)
    assert LlamaForCausalLM.from_pretrained(tmp_path / "main").generation_config.max_new_tokens == 7
    ours = filled(tmp_path)
    assert (ours.generation_config.max_new_tokens, ours.generation_config.top_k) == (7, 3)


def test_evaluate_before_train_on_empty_init_equals_the_eager_build(tmp_path):
    """Trainer's evaluation loop would move the meta modules to the device; OmniTrainer prepares them first, as
    train() will (LoRA injected, modules filled)."""
    tiny_model().save_pretrained(tmp_path / "saved")
    modules = {"vision": {"trainable": False}, "llm": {"lora": {"r": 2, "target_modules": ["q_proj"]}}}
    metrics, predictions = [], []
    for empty_init in (False, True):
        model = Captioner.from_pretrained(tmp_path / "saved", empty_init=empty_init)
        data = tiny_data(model, 16)
        trainer = OmniTrainer(model=model, args=make_args(tmp_path / str(empty_init), modules=modules,
                                                         per_device_eval_batch_size=8),
                              train_dataset=data, eval_dataset=data)
        metrics.append(trainer.evaluate()["eval_loss"])
        predictions.append(torch.as_tensor(trainer.predict(data).predictions))
        trainer.train()  # and training then starts from the prepared modules
        assert trainer.state.global_step == 4
    assert metrics[0] == metrics[1] and torch.equal(predictions[0], predictions[1])


def test_a_tensor_in_two_modules_is_refused(tmp_path):
    """A projector reusing the LLM's embedding table would be stepped by two optimizers: refused, naming both."""
    model = tiny_model()
    model.projector.shared = model.llm.get_input_embeddings()
    with pytest.raises(ValueError, match=r"modules 'projector' and 'llm' share a tensor \(shared.weight of "
                                         r"'projector', model.embed_tokens.weight of 'llm'\)"):
        OmniTrainer(model=model, args=make_args(tmp_path), train_dataset=tiny_data(model, 8))


def test_module_classes_are_checked_at_composition(tmp_path):
    """A class defined in a script is refused at from_modules (not at reload after training) until registered;
    a transformers class not exported at its top level is recorded by its module path and loads back."""
    from transformers.models.whisper.modeling_whisper import WhisperConfig, WhisperEncoder

    class MyTower(ViTModel):
        pass

    config = ViTConfig(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=16,
                       image_size=8, patch_size=4, num_channels=1)
    projector = Projector(ProjectorConfig(in_features=4, out_features=4))
    with pytest.raises(ValueError, match=r"module .main.: class MyTower .* hf_omni.register_module_class\(MyTower\)"):
        Single.from_modules({"main": MyTower(config), "projector": projector})
    register_module_class(MyTower)
    try:
        Single.from_modules({"main": MyTower(config), "projector": projector}).save_pretrained(tmp_path / "mine")
        assert type(Single.from_pretrained(tmp_path / "mine").main) is MyTower
    finally:
        REGISTERED.pop("MyTower")
    whisper = WhisperEncoder(WhisperConfig(num_mel_bins=8, d_model=16, encoder_layers=1, encoder_attention_heads=2,
                                           encoder_ffn_dim=16, max_source_positions=4, vocab_size=32))
    model = Single.from_modules({"main": whisper, "projector": projector})
    assert model.config.module_entry("main").cls == "transformers.models.whisper.modeling_whisper.WhisperEncoder"
    model.save_pretrained(tmp_path / "whisper")
    assert type(Single.from_pretrained(tmp_path / "whisper").main) is WhisperEncoder
    assert type(WhisperEncoder.from_pretrained(tmp_path / "whisper" / "main")) is WhisperEncoder


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory, launch_ranks):
    """tests/scripts/mp_downloaded.py at 2 gloo ranks, once for the tests below."""
    out = tmp_path_factory.mktemp("mp_downloaded")
    launch_ranks("mp_downloaded.py", str(out))
    return out, torch.load(out / "results.pt", weights_only=True)


def test_tied_embeddings_under_fsdp_at_two_ranks(two_ranks):
    """Gemma (lm_head tied to embed_tokens) and a T5 encoder (shared tied to encoder.embed_tokens), empty_init and
    sharded: one sharded parameter each, resumed bitwise on every rank; the export, reloaded in one process, gives
    the sharded model's logits."""
    from real_models import Batches, MultiEncoder

    out, ranks = two_ranks
    for rank in ranks:
        tied = rank["tied"]
        assert tied["wrapped"]["llm"] == tied["wrapped"]["t5"] == "fsdp" and tied["mismatch"] == []
        assert tied["llm_tied"] and tied["llm_sharded"] and tied["t5_tied"] and tied["t5_sharded"]
    export = MultiEncoder.from_pretrained(out / "tied" / "export")
    assert export.llm.lm_head.weight is export.llm.model.embed_tokens.weight
    batch = {k: torch.stack([Batches()[i][k] for i in range(4)]) for k in ("pixel_values", "text_ids", "input_ids")}
    with torch.no_grad():
        torch.testing.assert_close(export(**batch).logits, ranks[0]["tied"]["logits"], atol=1e-5, rtol=0)


def test_prepared_composites_and_parallel_none_at_two_ranks(two_ranks):
    for rank in two_ranks[1]:
        assert rank["accumulate"] == {"lrs_equal": True, "mismatch": []}
        assert rank["parallel_none"].startswith("modules.llm.parallel: `none` under a process group")


@pytest.mark.parametrize("across", [True, False])
def test_average_tokens_across_devices_at_two_ranks(two_ranks, across):
    """One SGD step at 2 ranks with 12 target tokens on rank 0 and 32 on rank 1, by hand in one process: with
    average_tokens_across_devices every token weighs the same (sum over all / 44); without, each rank's mean
    weighs the same (the mean of the two ranks' means), as Trainer defines it."""
    import copy

    from custom_loops import AVERAGE_TOKENS, UnevenTokens

    model = tiny_model()
    model.vision.requires_grad_(False)
    data = UnevenTokens(copy.deepcopy(model))
    ranks = [{k: torch.stack([data[i][k] for i in rows]) for k in data[0]} for rows in (range(4), range(4, 8))]
    sums, counts = [], []
    for batch in ranks:
        count = (batch["labels"] != -100).sum()
        sums.append(model(**batch, num_items_in_batch=1).loss)  # a sum over the batch's targets
        counts.append(count)
    loss = sum(sums) / sum(counts) if across else (sums[0] / counts[0] + sums[1] / counts[1]) / 2
    loss.backward()
    lr = AVERAGE_TOKENS["learning_rate"]
    got = two_ranks[1][0]["average_tokens"][across]
    other = two_ranks[1][0]["average_tokens"][not across]
    for name, param in model.named_parameters():
        if param.requires_grad:
            expected = param.detach() - lr * param.grad
            torch.testing.assert_close(got[name], expected, atol=2e-6, rtol=0)
    assert any(not torch.allclose(got[k], other[k], atol=1e-4) for k in got)  # the two rules differ here
    assert all(torch.equal(got[k], two_ranks[1][1]["average_tokens"][across][k]) for k in got)  # both ranks
