"""Boxes and gradient norms on 2-D meshes (tensor parallelism under FSDP2), before any strategy uses them.

In process, torch's fake process group as every rank of a 2x2 and a 2x4 (dp_shard, tp) mesh: `shards.box.local_box`
of the placements FSDP2 over tensor parallelism makes ((_StridedShard(0, sf=tp), Shard(0)) column splits,
(Shard(0), Shard(1)) row splits, ...) at uneven sizes is torch's own `compute_local_shape_and_global_offset`; what
a box cannot describe is refused by name. At 4 gloo ranks (one launch, tests/scripts/mp_tp_boxes.py): a tiny Llama
split by transformers' tensor-parallel plan and FSDP2, every parameter's box read from its full tensor, and the
per-module gradient norms and clipping against one process."""

import json

import pytest
import torch
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import _StridedShard

from hf_omni.compat import init_fake_process_group, strided_shard_factor
from hf_omni.shards.box import as_rows, local_box, local_rows, shard_dims, sharded_off_rows

COLUMNS = 6


def placements(tp: int) -> list[tuple]:
    return [(_StridedShard(0, sf=tp), Shard(0)),  # colwise (and embeddings, lm_head) under FSDP2
            (Shard(0), Shard(1)),  # rowwise under FSDP2
            (Shard(0), Replicate()),  # a plain layer's on the 2-D mesh
            (Replicate(), Shard(0)),
            (Shard(0), Shard(0)),  # two plain cuts of one dim: mesh order
            (_StridedShard(1, sf=tp), Shard(1))]


def on_mesh(shape: tuple[int, int], rank: int, body) -> None:
    """`body(mesh)` as rank `rank` of a (dp_shard, tp) mesh of `shape` (torch's fake process group)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    init_fake_process_group(rank, shape[0] * shape[1])
    try:
        body(init_device_mesh("cpu", shape, mesh_dim_names=("dp_shard", "tp")))
    finally:
        dist.destroy_process_group()


def dtensor(mesh, rows: int, placement) -> DTensor:
    """A (rows, COLUMNS) DTensor whose local shard has the shape torch gives this rank."""
    local_shape, _ = compute_local_shape_and_global_offset((rows, COLUMNS), mesh, placement)
    return DTensor.from_local(torch.empty(local_shape), mesh, placement, run_check=False,
                              shape=torch.Size((rows, COLUMNS)), stride=(COLUMNS, 1))


@pytest.mark.parametrize("shape", [(2, 2), (2, 4)])
def test_local_box_is_torchs_offset_and_shape_at_every_rank(shape):
    seen = {}

    def check(mesh):
        for rows in (7, 10, 130):
            for number, placement in enumerate(placements(shape[1])):
                tensor = dtensor(mesh, rows, placement)
                box = local_box(tensor)
                local_shape, offset = compute_local_shape_and_global_offset(tensor.shape, mesh, placement)
                sizes = tuple(b.stop - b.start for b in box)
                where = (mesh.get_coordinate(), rows, placement)
                assert sizes == tuple(local_shape) == tuple(tensor.to_local().shape), where
                assert all(b.start == o for b, o, n in zip(box, offset, sizes) if n), (where, box, offset)
                assert local_rows(tensor) == (box[0].start, box[0].stop)
                seen.setdefault((rows, number), set()).add(sizes)

    for rank in range(shape[0] * shape[1]):
        on_mesh(shape, rank, check)
    assert all(len(sizes) > 1 for (rows, _), sizes in seen.items() if rows == 7)  # uneven at every placement
    assert any(0 in size for sizes in seen.values() for size in sizes) == (shape == (2, 4))  # 7 rows: 4 + 3 at
    # tp 2, then 2 + 2 and 2 + 1 over dp; 2 + 2 + 2 + 1 at tp 4, then 1 + 1, ..., 1 + 0


def test_strided_rows_nest_inside_the_tensor_parallel_ones():
    """rows 10 over (dp_shard 2, tp 2): tp cuts 5 + 5, dp cuts each 3 + 2 (the design notes' table)."""
    boxes = {}

    def record(mesh):
        tensor = dtensor(mesh, 10, (_StridedShard(0, sf=2), Shard(0)))
        boxes[mesh.get_coordinate()] = local_rows(tensor)
        assert shard_dims(tensor) == {0: [1, 0]} and not sharded_off_rows(tensor)
        assert as_rows(tensor) is tensor  # already rows: no redistribution
        assert strided_shard_factor(tensor.placements[0]) == 2 and strided_shard_factor(Shard(0)) is None

    for rank in range(4):
        on_mesh((2, 2), rank, record)
    assert boxes == {(0, 0): (0, 3), (1, 0): (3, 5), (0, 1): (5, 8), (1, 1): (8, 10)}


def test_what_a_box_cannot_describe_is_refused_by_name():
    def check(mesh):
        def refused(placement, match):
            tensor = DTensor.from_local(torch.empty(2, COLUMNS), mesh, placement, run_check=False,
                                        shape=torch.Size((8, COLUMNS)), stride=(COLUMNS, 1))
            with pytest.raises(NotImplementedError, match=match):
                local_box(tensor)

        refused((Partial(), Shard(0)), "Shard.dim. placements")
        refused((_StridedShard(0, sf=4), Shard(0)), "cut the dim into sf parts")  # sf is not tp's 2 parts
        refused((_StridedShard(0, sf=2), Shard(1)), "cut the dim into sf parts")  # nothing inside it on dim 0
        refused((Shard(0), _StridedShard(0, sf=2)), "cut the dim into sf parts")  # a plain cut before it
        row_split = DTensor.from_local(torch.empty(4, 3), mesh, (Shard(0), Shard(1)), run_check=False,
                                       shape=torch.Size((8, COLUMNS)), stride=(COLUMNS, 1))
        assert local_box(row_split) == (slice(0, 4), slice(0, 3))  # two dims each cut once: a box already
        columns_twice = DTensor.from_local(torch.empty(8, 2), mesh, (Shard(1), Shard(1)), run_check=False,
                                           shape=torch.Size((8, COLUMNS)), stride=(COLUMNS, 1))
        with pytest.raises(NotImplementedError, match="one mesh dim shards one tensor dim"):
            as_rows(columns_twice)  # refused before any collective (a row split is gathered over its column dim)

    on_mesh((2, 2), 0, check)


def test_tensor_parallel_llama_boxes_norms_and_clipping_at_four_ranks(tmp_path, launch_ranks):
    launch_ranks("mp_tp_boxes.py", str(tmp_path), processes=4, timeout=300)
    for rank in range(4):
        report = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert report["problems"] == [], (rank, report["problems"])
        assert report["clipped"]
        kinds = {tuple(p) for p in report["placements"].values()}
        assert {("_S(0, 2)", "S(0)", "('dp_shard', 'tp')"), ("S(0)", "S(1)", "('dp_shard', 'tp')"),
                ("S(0)", "('dp_shard',)")} <= kinds, kinds  # column and row splits, norms on dp_shard alone
