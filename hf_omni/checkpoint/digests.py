"""sha256 of a checkpoint's files (`verify_checkpoint`), hashed by every rank in parallel, in fixed pieces.

Each file is cut into pieces of `PIECE` bytes (the last one shorter), whatever the world size; the pieces are dealt
to the ranks by size (the largest first, each to the least loaded rank), so a rank reads about total / world bytes
and no rank hashes the whole checkpoint inside an agreement window. The marker records `{file: [sha256 of each
piece]}`. At resume the same pieces are dealt over that run's ranks, whatever its world size, and each checks its
own before the ranks agree; one process (the CLI) checks them all. A marker written before pieces existed holds one
digest per file: the whole file is then one piece.
"""

from __future__ import annotations

import hashlib
import os

from ..core.dist import has_process_group
from ..core.errors import DamagedFileError
from .file_checks import EARLIER

PIECE = 256 * 2**20  # bytes hashed as one piece
READ = 8 * 2**20  # bytes read at a time


def pieces(sizes: dict[str, int]) -> list[tuple[str, int, int]]:
    """(file, offset, length) of every piece, files in sorted order (an empty file is one empty piece)."""
    out, piece = [], PIECE
    for rel in sorted(sizes):
        out += [(rel, offset, min(piece, sizes[rel] - offset)) for offset in range(0, sizes[rel], piece)] or \
               [(rel, 0, 0)]
    return out


def deal(lengths: list[int], world: int) -> list[list[int]]:
    """The piece indices each rank hashes: the largest first, each to the least loaded rank (ties: lowest rank)."""
    load, hands = [0] * world, [[] for _ in range(world)]
    for index in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        rank = min(range(world), key=lambda r: (load[r], r))
        hands[rank].append(index)
        load[rank] += lengths[index]
    return hands


def piece_sha256(path: str, offset: int, length: int) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        f.seek(offset)
        while length > 0:
            chunk = f.read(min(READ, length))
            if not chunk:
                break
            digest.update(chunk)
            length -= len(chunk)
    return digest.hexdigest()


def hash_share(directory: str, sizes: dict[str, int], rank: int, world: int) -> dict[int, str]:
    """This rank's pieces of the files listed in `sizes`: {piece index: sha256}."""
    cut = pieces(sizes)
    return {i: piece_sha256(os.path.join(directory, cut[i][0]), cut[i][1], cut[i][2])
            for i in deal([length for _, _, length in cut], world)[rank]}


def digests_by_file(sizes: dict[str, int], hashed: dict[int, str]) -> dict[str, list[str]]:
    """The marker's record from every rank's share (`hash_share`), merged."""
    out = {rel: [] for rel in sorted(sizes)}
    for index, (rel, _, _) in enumerate(pieces(sizes)):
        out[rel].append(hashed[index])
    return out


def hash_checkpoint(directory: str, sizes: dict[str, int], group) -> dict[str, list[str]] | None:
    """Every rank hashes its share, rank 0 receives the digests (one `gather_object` of hex strings): the
    marker's record on rank 0, None elsewhere."""
    import torch.distributed as dist

    if not has_process_group():
        return digests_by_file(sizes, hash_share(directory, sizes, 0, 1))
    mine = hash_share(directory, sizes, dist.get_rank(group), dist.get_world_size(group))
    everyone = [None] * dist.get_world_size(group) if dist.get_rank(group) == 0 else None
    dist.gather_object(mine, everyone, dst=dist.get_global_rank(group, 0) if group is not None else 0, group=group)
    if everyone is None:
        return None
    return digests_by_file(sizes, {i: h for share in everyone for i, h in share.items()})


def check_share(directory: str, sizes: dict[str, int], recorded: dict, rank: int = 0, world: int = 1,
                what: str | None = None) -> None:
    """Check this rank's pieces against the marker's record (`{file: [hex, ...]}`, or one hex per file from an
    older marker); a clear error naming the first file that differs (and `what` the folder is)."""
    what = what or f"checkpoint {directory}"
    if set(recorded) != set(sizes) or not all(isinstance(v, (str, list)) for v in recorded.values()):
        raise ValueError(f"{what} has no sha256 of its files to verify (saved without "
                         "verify_checkpoint)")
    cut, expected = [], []
    for rel in sorted(sizes):
        if isinstance(recorded[rel], str):  # one digest of the whole file
            cut.append((rel, 0, sizes[rel]))
            expected.append(recorded[rel])
            continue
        mine = pieces({rel: sizes[rel]})
        if len(mine) != len(recorded[rel]):
            raise DamagedFileError(os.path.join(directory, rel), f"{what}: file {rel} does not match its sha256 (its "
                                   f"pieces changed after the save); {EARLIER}")
        cut += mine
        expected += recorded[rel]
    for index in sorted(deal([length for _, _, length in cut], world)[rank]):
        rel, offset, length = cut[index]
        if piece_sha256(os.path.join(directory, rel), offset, length) != expected[index]:
            raise DamagedFileError(os.path.join(directory, rel), f"{what}: file {rel} does not match its sha256 at "
                                   f"bytes {offset}-{offset + length} (changed after the save); {EARLIER}")
