"""Checkpoints at the scale users train, checked at 4 gloo ranks (tests/scripts/mp_scale.py, one launch): every rank
writes its own part of each module's HF files (no rank receives a module's tensors), the parts are balanced, the
folders are what transformers' own `save_pretrained` writes, and a resume from them is bitwise."""

import json

import pytest
from launching import launch

LAYOUTS = ("full_shard", "hsdp")
MiB = 2**20


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("mp_scale")
    launch("mp_scale.py", str(out), processes=4)
    with open(out / "results.json") as f:
        return json.load(f)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_module_folders_are_what_transformers_writes(four_ranks, layout):
    """Written in parallel, each checkpoint and export folder holds the files transformers' `save_pretrained` writes
    from the gathered state (names, keys per file, header metadata, bytes of every tensor, index, generation
    config), records the module's own class, and loads back with it; the export is split into several files."""
    rank0 = four_ranks[0][layout]
    assert rank0["mismatches"] and all(problems == [] for problems in rank0["mismatches"].values()), \
        rank0["mismatches"]
    files = rank0["export_files"]
    assert "model.safetensors.index.json" in files and sum(f.endswith(".safetensors") for f in files) > 2


@pytest.mark.parametrize("layout", LAYOUTS)
def test_no_rank_receives_a_module_during_a_save(four_ranks, layout):
    """Gathering the 8 MB LLM to one rank would receive 3/4 of it there (6.3 MB); a checkpoint save receives only
    DCP's plans and the agreement flags (under 1 MiB, the largest tensor), an export the flags and the 19-row
    embedding and LM head, which are sharded on their columns (`parallel/placement.py`) and redistributed to rows
    to be written: gloo has no all-to-all, so each rank receives 3/4 of those two (2 x 19 x 256 fp32: 29 KB)."""
    llm = four_ranks[0][layout]["module_bytes"]["llm"]
    assert llm > 8 * 10**6
    for rank in four_ranks:
        assert rank[layout]["save"]["received"] < MiB, rank[layout]["save"]["by_name"]
        assert rank[layout]["export"]["received"] < 4096 + 2 * 19 * 256 * 4, rank[layout]["export"]["by_name"]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("what", ["save", "export"])
def test_every_rank_writes_a_balanced_share(four_ranks, layout, what):
    """Bytes written per rank (`wchar`, every write of the process) within 1.5x of the total / world: under HSDP
    the replicas split their shard's rows, replicated (DDP) tensors are split over every rank."""
    written = [rank[layout][what]["written"] for rank in four_ranks]
    assert max(written) <= 1.5 * sum(written) / len(written), written
    if what == "save":
        assert sum(written) >= four_ranks[0][layout]["checkpoint_bytes"]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_resume_from_the_parallel_files_is_bitwise(four_ranks, layout):
    """A run started from other weights, resumed from the checkpoint, takes the next step bitwise equal."""
    assert all(rank[layout]["resume_mismatch"] == [] for rank in four_ranks)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_rank_hashes_its_share_of_the_checkpoint(four_ranks, layout):
    """`verify_checkpoint`: at the save every piece of every file is hashed once in all, each rank about a quarter
    (not rank 0 alone); at the resume the pieces are dealt again and each rank checks its own."""
    total = four_ranks[0][layout]["listed_bytes"]  # every file the marker lists
    for what in ("save", "load"):
        hashed = [rank[layout][what]["hashed"] for rank in four_ranks]
        assert max(hashed) <= 1.5 * total / 4, (what, hashed, total)
        assert sum(hashed) == total


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_corrupted_piece_is_found_by_its_rank_and_every_rank_raises(four_ranks, layout):
    """One byte flipped in the middle of the LLM's weights (size kept): the rank its piece is dealt to finds it,
    every rank raises the same error naming the file, the bytes and that rank."""
    messages = {rank[layout]["corrupted"] for rank in four_ranks}
    assert len(messages) == 1, messages
    message = messages.pop()
    assert "llm/model.safetensors does not match its sha256 at bytes" in message and "on rank" in message


def test_pieces_are_dealt_by_size_whatever_the_world(monkeypatch, tmp_path):
    """Files cut into fixed pieces; the pieces dealt largest first to the least loaded rank; a marker from a
    4-rank save is checked at 1, 2 or 3 ranks (each its own share) and an older whole-file digest still checks."""
    from hf_omni.checkpoint import digests

    monkeypatch.setattr(digests, "PIECE", 10)
    sizes = {"a": 25, "b": 0, "c": 10}
    assert digests.pieces(sizes) == [("a", 0, 10), ("a", 10, 10), ("a", 20, 5), ("b", 0, 0), ("c", 0, 10)]
    assert digests.deal([10, 10, 5, 0, 10], 2) == [[0, 4], [1, 2, 3]]
    for name, size in sizes.items():
        (tmp_path / name).write_bytes(bytes(range(size)))
    hashed = {}
    for rank in range(4):
        hashed.update(digests.hash_share(str(tmp_path), sizes, rank, 4))
    recorded = digests.digests_by_file(sizes, hashed)
    assert [len(v) for v in recorded.values()] == [3, 1, 1]
    for world in (1, 2, 3):
        for rank in range(world):
            digests.check_share(str(tmp_path), sizes, recorded, rank, world)
    import hashlib

    digests.check_share(str(tmp_path), sizes, {k: hashlib.sha256((tmp_path / k).read_bytes()).hexdigest()
                                               for k in sizes})
    (tmp_path / "a").write_bytes(bytes(range(12)) + b"\xff" + bytes(range(13, 25)))
    found = []
    for rank in range(2):
        try:
            digests.check_share(str(tmp_path), sizes, recorded, rank, 2)
        except ValueError as err:
            found.append((rank, str(err)))
    assert len(found) == 1 and "file a does not match its sha256 at bytes 10-20" in found[0][1]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_resume_reads_each_byte_once(four_ranks, layout):
    """At resume the ranks together request at most the checkpoint's bytes from disk (hf_omni's and DCP's readers,
    counted): under HSDP each of the LLM's tensors is read by one replica (they share the reading) and sent to the
    other; a module every rank holds whole (DDP) is read in stripes (each rank its share of the tensors) and
    broadcast."""
    ranks = [rank[layout]["load"] for rank in four_ranks]
    total = four_ranks[0][layout]["listed_bytes"]
    assert sum(rank["read"] for rank in ranks) <= total, [rank["read"] for rank in ranks]
    if layout == "hsdp":  # replicas {0, 1} and {2, 3}: each reads about half of its shard's bytes, receives the rest
        reads = [rank["read"] for rank in ranks]
        assert max(reads) <= 1.3 * min(reads) and all(rank["received"] > 5 * MiB for rank in ranks), ranks


@pytest.mark.parametrize("layout", LAYOUTS)
def test_resume_opens_only_the_files_a_rank_reads(four_ranks, layout):
    """At resume at the same world size, a rank opens the LLM's optimizer shard files it wrote and no other: the
    shard headers DCP's metadata needs are read by rank 0 of each load's group (the two shard groups under HSDP)
    and broadcast, and AdamW's step counts live in optimizer.json rather than in one rank's shards."""
    heads = {0} if layout == "full_shard" else {0, 2}
    for rank, results in enumerate(four_ranks):
        opened = [p.split(f"{layout}/checkpoint-1/", 1)[1] for p in results[layout]["load"]["opened"]]
        shards = [p for p in opened if p.startswith("llm/state/")]
        own = {p for p in shards if p.startswith(f"llm/state/shard-{rank + 1:05d}-")}
        if rank in heads:
            assert all(shards.count(p) <= 2 for p in shards), shards  # the headers once, its own rows once
        else:
            assert set(shards) == own and len(own) == 2, (rank, opened)
        assert not [p for p in opened if p.startswith(("vision/state/", "projector/state/"))] or rank in heads or \
            layout == "hsdp", (rank, opened)  # DDP modules' state: read by rank 0 alone


def test_side_groups_are_few_and_use_ddp_timeout(four_ranks):
    """Over the whole launch (two layouts, four prepared runs, an async save, resumes, exports) hf_omni makes two
    gloo groups beside training's: one for the main thread's agreements and one for the async writer thread, each
    with `ddp_timeout`, made once and reused."""
    for rank in four_ranks:
        assert sorted(rank["side_groups"]) == [["MainThread", 321.0], ["MainThread", 321.0]], rank["side_groups"]


def test_a_merged_lora_export_is_merged_row_by_row(four_ranks):
    """`save_pretrained(merge_lora=True)` of the fully sharded DoRA LLM with a trained `lm_head` copy
    (`modules_to_save`): every rank merges and writes its own rows (its rows of W, B and the magnitude vector, and
    of the copy; receiving only lora_A, r rows per layer: well under 64 KB, where a gathered LLM would be 6.3 MB);
    the file equals PEFT's own merge of the gathered module and has no adapter beside it."""
    rank0 = four_ranks[0]["lora_merge"]
    assert rank0["keys_equal"] and rank0["max_diff"] <= 1e-6 and rank0["adapter_files"] == []
    for rank in four_ranks:
        assert rank["lora_merge"]["export"]["received"] < 64 * 1024, rank["lora_merge"]["export"]["by_name"]


def test_moe_experts_under_empty_init_are_read_row_by_row(four_ranks):
    """A Mixtral of 4 experts, fully sharded over 4 ranks and filled with `empty_init`: each rank reads its own
    rows, its expert's file tensors among them, never the module through transformers' loading; in all the ranks
    read the file's tensors once, and the module equals transformers' own load bitwise."""
    rank0 = four_ranks[0]["moe_rows"]
    assert rank0["equal"] and any("gate_up_proj" in k for k in rank0["experts"]), rank0["experts"]
    reads = [rank["moe_rows"]["fill"]["read"] for rank in four_ranks]
    assert sum(reads) <= rank0["file_bytes"] and max(reads) <= 0.4 * rank0["file_bytes"], (reads, rank0["file_bytes"])


def test_a_module_every_rank_holds_whole_is_read_in_stripes(four_ranks):
    """Built with `empty_init` and held whole by every rank (ddp, or frozen and unwrapped), each module is read in
    stripes: each of the 4 ranks reads its share of the tensors (dealt by bytes: at most a quarter of the module
    plus one tensor), then each tensor is broadcast from its reader; in all the ranks read each module's bytes once
    (where every rank reading the whole module reads it 4 times), and every rank ends with the saved weights."""
    for name, size in four_ranks[0]["striped"]["file_bytes"].items():
        reads = [rank["striped"]["read"][name] for rank in four_ranks]
        largest = four_ranks[0]["striped"]["largest"][name]
        assert sum(reads) <= 1.1 * size and max(reads) <= size / 4 + largest, (name, reads, size, largest)
    assert all(rank["striped"]["mismatch"] == [] for rank in four_ranks)


def test_stripes_of_a_70b_module_at_512_ranks():
    """The deal of a module every rank holds whole (`shards.replicas.stripes`, on meta tensors of a Llama-70B's
    shapes in bf16: 723 tensors, 141 GB): each tensor to one rank, no rank over 1 / world of the bytes plus the
    largest tensor (2.1 GB, the embedding table), and at 4 ranks within 1% of a quarter each."""
    import torch

    from hf_omni.shards.replicas import stripes

    hidden, kv, mlp, vocab = 8192, 1024, 28672, 128256
    layer = [(hidden, hidden), (kv, hidden), (kv, hidden), (hidden, hidden), (mlp, hidden), (mlp, hidden),
             (hidden, mlp), (hidden,), (hidden,)]
    shapes = [(vocab, hidden), *layer * 80, (hidden,), (vocab, hidden)]
    tensors = [torch.empty(shape, dtype=torch.bfloat16, device="meta") for shape in shapes]
    sizes = [t.numel() * 2 for t in tensors]
    total, largest = sum(sizes), max(sizes)
    assert len(tensors) == 723 and 140e9 < total < 142e9 and largest == vocab * hidden * 2
    for world, slack in ((512, largest), (4, 0.01 * total / 4)):
        owners = stripes(tensors, world)
        loads = [0] * world
        for owner, size in zip(owners, sizes):
            loads[owner] += size
        assert sum(loads) == total and max(loads) <= total / world + slack, (world, max(loads))
