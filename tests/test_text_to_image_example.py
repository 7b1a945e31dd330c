"""examples/text_to_image.py's code path, a few steps on a few rows: the saved folder is an IFPipeline that samples
8x8 grey images, the UNet trained and the frozen T5 left as built; and the scorer on cases with known answers."""

import os

import numpy as np
import text_to_image
import torch
from diffusers import IFPipeline

from hf_omni.testing.digits_t2i import build_pipeline, fit_scorer, generate, load_splits, score

CONFIG = os.path.join(os.path.dirname(text_to_image.__file__), "text_to_image.yaml")


def test_example_trains_saves_and_samples_an_if_pipeline(tmp_path):
    out = str(tmp_path / "out")
    result = text_to_image.main([CONFIG, "--output_dir", out, "--max_steps", "3", "--per_device_train_batch_size",
                                 "8", "--train_rows", "32", "--per_digit", "1", "--sampling_steps", "2",
                                 "--disable_tqdm", "true"])
    assert 0.0 <= result["score"] <= 1.0 and result["train_seconds"] > 0
    assert os.path.isfile(os.path.join(out, "samples.png"))
    pipe = IFPipeline.from_pretrained(out)
    built = build_pipeline(seed=0)  # the config's seed: the weights the run started from
    for name, param in pipe.text_encoder.state_dict().items():
        assert torch.equal(param, built.text_encoder.state_dict()[name]), name  # frozen
    assert any(not torch.equal(p, built.unet.state_dict()[n]) for n, p in pipe.unet.state_dict().items())  # trained
    images, digits = generate(pipe, per_digit=2, steps=2)
    assert images.shape == (20, 8, 8) and list(digits[::2]) == list(range(10))
    assert images.min() >= 0.0 and images.max() <= 1.0 and images.std() > 0


def test_scorer_reads_real_digits_and_not_noise():
    (train_x, train_y), (held_x, held_y) = load_splits()
    assert len(train_x) + len(held_x) == 1797
    assert np.abs(np.bincount(train_y) - np.bincount(held_y)).max() <= 1  # stratified halves
    classifier = fit_scorer(held_x, held_y)
    assert score(classifier, train_x.reshape(-1, 8, 8) / 16.0, train_y) >= 0.9  # digits it never saw: 96%
    rng = np.random.default_rng(0)
    assert score(classifier, rng.random((1000, 8, 8)), np.repeat(np.arange(10), 100)) <= 0.2  # chance: 10%
    assert score(classifier, train_x.reshape(-1, 8, 8) / 16.0, (train_y + 1) % 10) <= 0.05  # wrong prompts


def test_sample_images_of_a_grey_pipeline_are_logged(tmp_path):
    """SampleImagesCallback on a one-channel pipeline: grey PNGs of the pipeline's size, and TensorBoard images."""
    from PIL import Image

    from hf_omni import OmniTrainer, OmniTrainingArguments, SampleImagesCallback
    from hf_omni.testing.digits_t2i import DigitPrompts, DigitT2I

    model = DigitT2I.from_pipeline(build_pipeline())
    (x, y), _ = load_splits()
    args = OmniTrainingArguments(output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=4, use_cpu=True,
                                 report_to=["tensorboard"], save_strategy="no", disable_tqdm=True,
                                 modules={"text_encoder": {"trainable": False}})
    trainer = OmniTrainer(model=model, args=args, train_dataset=DigitPrompts(x[:8], y[:8],
                                                                             model.processors["text_encoder"]))
    trainer.add_callback(SampleImagesCallback(["a handwritten 7", "a handwritten 1"], every_n_steps=1,
                                              num_inference_steps=2))
    trainer.train()
    assert sorted(os.listdir(tmp_path / "samples")) == ["step-1", "step-2"]
    image = Image.open(tmp_path / "samples" / "step-2" / "1.png")
    assert image.mode == "L" and image.size == (8, 8)
    assert os.listdir(tmp_path / "runs" / "samples")
