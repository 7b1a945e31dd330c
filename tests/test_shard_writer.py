"""`ShardWriter` writes what torch's `HuggingFaceStorageReader` reads back exactly: every dtype, 0-dim and empty
tensors, split over several files, buffered or O_DIRECT; a shard is a valid safetensors file; a non-tensor is
refused by name."""

import os

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors import safe_open
from torch.distributed.checkpoint import HuggingFaceStorageReader

from hf_omni.checkpoint.shard_writer import ShardWriter
from hf_omni.core.dtypes import SAFETENSORS as DTYPES


def sample_state():
    g = torch.Generator().manual_seed(0)
    state = {f"t_{str(dtype).split('.')[-1]}": (torch.randn(5, 3, generator=g) * 50).to(dtype) for dtype in DTYPES}
    state.update(step=torch.tensor(7.0), empty=torch.zeros(0, 4), big=torch.randn(1000, 333, generator=g),
                 odd=torch.randn(7, generator=g)[::2])  # a non-contiguous view
    return {"optimizer": {"state": state}}


@pytest.mark.parametrize("threads,direct", [(1, False), (3, False), (2, True)])
def test_round_trip_through_torch_reader(tmp_path, threads, direct):
    state = sample_state()
    dcp.save(state, storage_writer=ShardWriter(str(tmp_path), threads=threads, direct=direct))
    files = sorted(f for f in os.listdir(tmp_path) if f.endswith(".safetensors"))
    assert len(files) == threads and not (tmp_path / ".metadata").exists()
    with safe_open(str(tmp_path / files[0]), framework="pt") as f:  # a plain safetensors file
        assert f.metadata()["format"] == "pt"
    back = {"optimizer": {"state": {k: torch.full_like(v, 3) for k, v in state["optimizer"]["state"].items()}}}
    dcp.load(back, storage_reader=HuggingFaceStorageReader(str(tmp_path)))
    for key, value in state["optimizer"]["state"].items():
        assert torch.equal(back["optimizer"]["state"][key], value), key


def test_a_non_tensor_is_refused_by_name(tmp_path):
    with pytest.raises(BaseException, match="optimizer.note is not a tensor"):  # DCP's CheckpointException
        dcp.save({"optimizer": {"note": "hello"}}, storage_writer=ShardWriter(str(tmp_path)))
