"""The eager inference build: `from_pretrained(dir, device_map=..., dtype=..., merge_lora=...)` in one process,
eval mode, reproducing the trained model's outputs; per-module placement and dtypes; a bad module name refused."""

import pytest
import torch
from helpers import make_args, tiny_data, tiny_model

from hf_omni import OmniTrainer
from hf_omni.testing.digits import Captioner

MODULES = {"vision": {"trainable": False}, "projector": {"learning_rate": 3e-3},
           "llm": {"learning_rate": 1e-2, "lora": {"r": 4, "target_modules": ["q_proj", "v_proj"]}}}


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    out = tmp_path_factory.mktemp("eager")
    model = tiny_model()
    trainer = OmniTrainer(model=model, args=make_args(out, max_steps=4, modules=MODULES),
                          train_dataset=tiny_data(model, 32))
    trainer.train()
    trainer.save_model(str(out / "export"))
    batch = {k: torch.stack([tiny_data(model, 4)[i][k] for i in range(4)]) for k in ("pixel_values", "input_ids")}
    model.eval()
    with torch.no_grad():
        logits = model(**batch).logits
    return out / "export", batch, logits


def test_eager_build_reproduces_the_trained_model(trained):
    export, batch, logits = trained
    for kwargs in ({}, {"device_map": "cpu"}, {"device_map": "auto"}, {"merge_lora": True},
                   {"device_map": {"vision": "cpu", "llm": "cpu"}}):
        model = Captioner.from_pretrained(str(export), **kwargs)
        assert not model.training and not any(m.training for m in model.modules())
        with torch.no_grad():
            torch.testing.assert_close(model(**batch).logits, logits, atol=1e-5, rtol=0)
    merged = Captioner.from_pretrained(str(export), merge_lora=True)
    assert not any("lora_" in n for n, _ in merged.llm.named_parameters())


def test_per_module_dtype_and_bad_names(trained):
    export, batch, logits = trained
    model = Captioner.from_pretrained(str(export), dtype={"llm": torch.bfloat16})
    assert model.llm.dtype == torch.bfloat16 and model.vision.dtype == torch.float32
    model = Captioner.from_pretrained(str(export), dtype=torch.float64)
    assert {m.dtype for m in model.omni_modules().values()} == {torch.float64}
    with pytest.raises(ValueError, match=r"device_map names \['audio'\], not modules of this model"):
        Captioner.from_pretrained(str(export), device_map={"audio": "cpu"})
    with pytest.raises(ValueError, match="empty_init .* takes no device_map"):
        Captioner.from_pretrained(str(export), empty_init=True, dtype=torch.float16)


def test_caption_script_decodes_as_the_training_script(trained):
    """examples/caption.py (llm.generate with its KV cache, from the export) and the training script's greedy loop
    produce the same captions, up to the first [EOS] where generate stops: the same accuracy."""
    import caption

    from hf_omni.testing.digits import greedy_captions, load_splits

    export, _, _ = trained
    model = Captioner.from_pretrained(str(export))
    _, held_out = load_splits(model.processors["llm"])
    length, eos = held_out.input_ids.shape[1], model.processors["llm"].eos_token_id
    looped = greedy_captions(model, held_out.pixels[:64], length)
    generated = caption.generate_captions(model, held_out.pixels[:64], length)
    for a, b in zip(looped.tolist(), generated.tolist()):
        stop = b.index(eos) + 1 if eos in b else length
        assert a[:stop] == b[:stop]
