"""Bytes per shard entry of the DCP `Metadata` a resume broadcasts (docs/checkpoint_internals.md).

    python bench/metadata_size.py [--entries 100 1000 10000]

One process: a state dict of N 4x4 fp32 tensors with 27-character names saved with DCP's `FileSystemWriter`, its
metadata read back and pickled as the broadcast pickles it. Prints the pickled size and the bytes per entry
(deterministic: the same every run for one torch version). A rank's share of a resume's metadata at scale is the
per-entry figure times the entries (tensors x the ranks that saved a piece of each).
"""

from __future__ import annotations

import argparse
import pickle
import tempfile

import torch
import torch.distributed.checkpoint as dcp


def pickled_metadata_bytes(entries: int) -> int:
    state = {f"model.layers.{i:05d}.mlp.weight"[:27].ljust(27, "x"): torch.zeros(4, 4) for i in range(entries)}
    assert len(state) == entries
    with tempfile.TemporaryDirectory() as folder:
        dcp.save(state, storage_writer=dcp.FileSystemWriter(folder), no_dist=True)
        metadata = dcp.FileSystemReader(folder).read_metadata()
    return len(pickle.dumps(metadata))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--entries", type=int, nargs="+", default=[100, 1000, 10000])
    options = parser.parse_args()
    print("| entries | pickled Metadata (B) | B per entry |\n|---|---|---|")
    for entries in options.entries:
        size = pickled_metadata_bytes(entries)
        print(f"| {entries} | {size:,} | {size / entries:.0f} |")


if __name__ == "__main__":
    main()
