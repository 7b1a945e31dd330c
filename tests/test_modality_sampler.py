"""`group_by_modality`: each global batch of one modality set (which entry points have inputs), every row served each
epoch, groups padded with their own rows; the rows' modalities read from a `modalities` attribute, a
`datasets.Dataset`'s null masks, or the rows themselves. The 2-rank run is in tests/scripts/mp_step.py."""

import pytest
import torch
from datasets import Dataset
from helpers import make_args

from hf_omni import OmniTrainer
from hf_omni.core.errors import OmniArgumentError
from hf_omni.offline.modality_sampler import ModalityGroupedSampler, row_modalities

COLUMNS = {"vision": ["pixel_values", "image_features"], "audio": ["input_features"]}
KEYS = [("vision",)] * 7 + [()] * 5 + [("audio", "vision")] * 2  # 14 rows, three groups


def test_every_global_batch_is_one_group_and_every_row_is_served():
    sampler = ModalityGroupedSampler(KEYS, global_batch=4, seed=3)
    order = list(sampler)
    assert len(order) == len(sampler) == 8 + 8 + 4  # 7 -> 8, 5 -> 8, 2 -> 4: padded to whole batches
    batches = [order[i:i + 4] for i in range(0, len(order), 4)]
    assert all(len({KEYS[i] for i in batch}) == 1 for batch in batches), batches
    assert set(order) == set(range(len(KEYS)))  # every row, the padding repeating rows of the same group
    assert sorted(order).count(12) + sorted(order).count(13) == 4


def test_the_order_follows_seed_and_epoch_and_sequential_keeps_dataset_order():
    first, again = ModalityGroupedSampler(KEYS, 4, seed=3), ModalityGroupedSampler(KEYS, 4, seed=3)
    assert list(first) == list(again)
    epoch0 = list(first)
    first.set_epoch(1)
    assert list(first) != epoch0 and sorted(set(first)) == sorted(set(epoch0))
    sequential = list(ModalityGroupedSampler(KEYS, 4, shuffle=False))
    assert sequential == [0, 1, 2, 3, 4, 5, 6, 0, 7, 8, 9, 10, 11, 7, 8, 9, 12, 13, 12, 13]


def test_modalities_from_an_attribute_from_null_masks_and_from_rows():
    class Rows(torch.utils.data.Dataset):
        modalities = None

        def __len__(self):
            return 3

        def __getitem__(self, i):
            return {"input_ids": torch.ones(2)} | ({"pixel_values": torch.ones(1)} if i != 1 else {}) | \
                ({"input_features": torch.ones(1)} if i == 2 else {})

    assert row_modalities(Rows(), COLUMNS) == [("vision",), (), ("audio", "vision")]
    given = Rows()
    given.modalities = [["vision"], [], ["vision", "audio"]]
    assert row_modalities(given, COLUMNS) == [("vision",), (), ("audio", "vision")]
    given.modalities = [["vision"]]
    with pytest.raises(ValueError, match="1 entries for 3 rows"):
        row_modalities(given, COLUMNS)
    table = Dataset.from_dict({"input_ids": [[1], [2], [3]], "pixel_values": [[0.5], None, [0.1]]})
    assert row_modalities(table, COLUMNS) == [("vision",), (), ("vision",)]


def test_it_goes_with_random_or_sequential_sampling_only(tmp_path):
    with pytest.raises(OmniArgumentError, match="group_by_modality.*'group_by_length'"):
        make_args(tmp_path, group_by_modality=True, train_sampling_strategy="group_by_length")


def test_one_process_serves_batches_of_one_modality(tmp_path):
    import mixed_modality

    model = mixed_modality.mixed_model()
    has_image = [i % 3 != 0 for i in range(24)]
    data = mixed_modality.MixedCaptions(model, has_image)
    trainer = OmniTrainer(model=model, args=make_args(tmp_path, group_by_modality=True, per_device_train_batch_size=4,
                                                      train_sampling_strategy="random"),
                          train_dataset=data, data_collator=mixed_modality.collate)
    batches = list(trainer.get_train_dataloader())
    assert len(batches) == 6 and {("pixel_values" in b) for b in batches} == {True, False}
    assert all(len(b["input_ids"]) == 4 and ("pixel_values" not in b or len(b["pixel_values"]) == 4) for b in batches)

