"""Offline outputs of different lengths per image: a Qwen2.5-VL vision tower (tiny config) returns a tuple of
per-image tensors whose token counts follow each image's resolution. Its cache keeps each image's output and
serves a batch's in the same form; training from the cache equals training online (<= 1e-6)."""

import pytest
import torch
from helpers import make_args, tiny_model
from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import Qwen2_5_VLVisionConfig
from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel

from hf_omni import OmniModel, OmniTrainer, Projector, ProjectorConfig, offline_encoder

GRIDS = [[1, 4, 4], [1, 2, 6], [1, 4, 6], [1, 2, 2]]  # (t, h, w) patches: 4, 3, 6 and 1 tokens after the 2x2 merge
ROWS = [[0], [1, 2], [], [3], [2, 0], [1], [], [3, 1]]  # each row's images (by grid); [] : text only
LENGTH = 24


def tokens(grid) -> int:
    return grid[0] * grid[1] * grid[2] // 4


class QwenStyle(OmniModel):
    """Qwen2.5-VL's way: the tower's merged tokens per image, scattered into the image placeholders."""

    @offline_encoder(module="vision", inputs=["pixel_values", "image_grid_thw"], output="image_features",
                     ragged="tuple", items="image_grid_thw")
    def encode_image(self, pixel_values, image_grid_thw):
        merged = self.vision(pixel_values, grid_thw=image_grid_thw).pooler_output
        return torch.split(merged, (image_grid_thw.prod(-1) // 4).tolist())

    def forward(self, input_ids, pixel_values=None, image_grid_thw=None, image_features=None, labels=None, **kw):
        embeds = self.llm.get_input_embeddings()(input_ids)
        feats = image_features if image_features is not None else self.encode_image(pixel_values, image_grid_thw)
        if feats is not None:
            slots = (input_ids == 1).unsqueeze(-1)  # [UNK] marks an image token
            embeds = embeds.masked_scatter(slots, self.projector(torch.cat(feats)).to(embeds.dtype))
        return self.llm(inputs_embeds=embeds, labels=labels, **kw)


def build(seed: int = 0) -> QwenStyle:
    torch.manual_seed(seed)
    tower = Qwen2_5_VisionTransformerPretrainedModel(Qwen2_5_VLVisionConfig(
        depth=2, hidden_size=32, intermediate_size=64, num_heads=2, in_channels=3, patch_size=2, spatial_merge_size=2,
        temporal_patch_size=1, out_hidden_size=24, window_size=8, fullatt_block_indexes=[1]))
    base = tiny_model(seed)
    projector = Projector(ProjectorConfig(in_features=24, out_features=base.llm.config.hidden_size, hidden_size=32))
    return QwenStyle.from_modules({"vision": tower, "projector": projector, "llm": base.llm},
                                  processors={"llm": base.processors["llm"]})


class Rows(torch.utils.data.Dataset):
    """Rows of 0-2 images of mixed resolutions: flattened patches + grid, placeholders, then caption tokens."""

    def __init__(self):
        generator = torch.Generator().manual_seed(1)
        self.pixels = [torch.randn(g[0] * g[1] * g[2], 12, generator=generator) for g in GRIDS]
        self.words = torch.randint(4, 19, (len(ROWS), LENGTH), generator=generator)

    def __len__(self):
        return len(ROWS)

    def __getitem__(self, i):
        images = ROWS[i]
        ids = self.words[i].clone()
        ids[:sum(tokens(GRIDS[g]) for g in images)] = 1
        labels = torch.where(ids == 1, -100, ids)
        row = {"input_ids": ids, "labels": labels}
        if images:
            row |= {"pixel_values": torch.cat([self.pixels[g] for g in images]),
                    "image_grid_thw": torch.tensor([GRIDS[g] for g in images])}
        return row


def collate(rows: list[dict]) -> dict:
    """Qwen2.5-VL's layout: patches and grids concatenated over the batch's images; a batch without any has none
    (encoding calls it with the encoder's input columns alone)."""
    batch = {k: torch.stack([r[k] for r in rows]) for k in ("input_ids", "labels") if k in rows[0]}
    with_images = [r for r in rows if "pixel_values" in r]
    if with_images:
        batch["pixel_values"] = torch.cat([r["pixel_values"] for r in with_images])
        batch["image_grid_thw"] = torch.cat([r["image_grid_thw"] for r in with_images])
    return batch


def train(tmp_path, name: str, **extra):
    model = build()
    args = make_args(tmp_path / name, per_device_train_batch_size=2, max_steps=4, learning_rate=1e-3,
                     modules={"vision": {"trainable": False}}, **extra)
    trainer = OmniTrainer(model=model, args=args, train_dataset=Rows(), data_collator=collate)
    trainer.train()
    return trainer


def test_training_from_the_cache_equals_training_online(tmp_path):
    online, offline = train(tmp_path, "online"), train(tmp_path, "offline", offline_modules=["vision"])
    assert offline.model.slots["vision"].is_offline
    losses = [[e["loss"] for e in t.state.log_history if "loss" in e] for t in (online, offline)]
    assert len(losses[0]) == 4 and losses[0] == pytest.approx(losses[1], abs=1e-6)
    for (name, a), (_, b) in zip(online.model.projector.named_parameters(), offline.model.projector.named_parameters()):
        assert torch.allclose(a, b, atol=1e-6), name


def test_each_image_is_cached_and_a_batch_is_served_in_the_methods_form(tmp_path):
    trainer = train(tmp_path, "served", offline_modules=["vision"])
    reference, data = build().eval(), Rows()
    served = trainer.train_dataset
    for i, images in enumerate(ROWS):
        row = served[i]
        if not images:
            assert "image_features" not in row and "pixel_values" not in row
            continue
        assert isinstance(row["image_features"], tuple) and [len(t) for t in row["image_features"]] == \
            [tokens(GRIDS[g]) for g in images]
        with torch.no_grad():
            alone = reference.encode_image(data[i]["pixel_values"], data[i]["image_grid_thw"])
        assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(row["image_features"], alone))
    batch = trainer.data_collator([served[1], served[2], served[4]])
    assert isinstance(batch["image_features"], tuple) and [len(t) for t in batch["image_features"]] == [3, 6, 6, 4]
    assert "pixel_values" not in batch and batch["input_ids"].shape == (3, LENGTH)


def test_concat_form_serves_values_and_sizes(tmp_path):
    from hf_omni.offline.ragged import ServedCollator, batch_form, split_rows
    from hf_omni.offline.spec import OfflineEncoder

    spec = OfflineEncoder("vision", ("pixel_values", "image_grid_thw"), "image_features", "encode", "concat",
                          "image_grid_thw")
    values = torch.arange(10.0).view(5, 2)
    rows = split_rows(spec, (values, torch.tensor([2, 1, 2])), [2, 1])
    assert [sizes for _, sizes in rows] == [[2, 1], [2]] and torch.equal(rows[0][0], values[:3])
    batched, sizes = batch_form(spec, [tuple(torch.split(v, s)) for v, s in rows])
    assert torch.equal(batched, values) and sizes.tolist() == [2, 1, 2]
    served = ServedCollator(collate, [spec])([{"input_ids": torch.ones(2), "labels": torch.ones(2),
                                               "image_features": (values[:2],)}])
    assert torch.equal(served["image_features"][0], values[:2]) and served["image_features"][1].tolist() == [2]
    with pytest.raises(ValueError, match=r"sizes \[2, 2\] do not add up to the 5 rows"):
        split_rows(spec, (values, [2, 2]), [2])
    with pytest.raises(ValueError, match="returned 3 items for rows holding 4"):
        split_rows(spec, (values, [2, 1, 2]), [2, 2])


def test_a_ragged_encoder_must_return_its_declared_form():
    from hf_omni.offline.ragged import items_of
    from hf_omni.offline.spec import OfflineEncoder

    spec = OfflineEncoder("vision", ("pixel_values",), "image_features", "encode", "tuple")
    with pytest.raises(ValueError, match="ragged='tuple': it must return a tuple of per-item tensors, got Tensor"):
        items_of(spec, torch.ones(2, 2))
    with pytest.raises(ValueError, match="items='mask' names the input column"):
        offline_encoder(module="vision", inputs=["pixel_values"], output="f", ragged="tuple", items="mask")
    with pytest.raises(ValueError, match="ragged must be one of"):
        offline_encoder(module="vision", inputs=["pixel_values"], output="f", ragged="list")
