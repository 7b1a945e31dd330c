"""Batches of an adopted model that lack a modality on some ranks. The released model's own `forward` decides which
of its submodules run from the inputs it is given (LLaVA and Qwen2.5-VL skip their vision tower without
`pixel_values`), so a rank without images would skip the vision module's collectives while the others enter them:
a hang under NCCL. Before the released forward runs, every rank shares which of its `forward`'s arguments it was
given (one all-gather of host integers on hf_omni's gloo side group: no device memory is read); where they differ,
every rank raises the same error before any module's collective.

Gradients of an adopted model are reduced at every micro-step (not only at an accumulation window's last): a module
its forward skipped at the window's last micro-step would otherwise keep gradients that were never reduced."""

from __future__ import annotations

from ..core.dist import all_gather_host, checkpoint_group
from ..offline.exchange import given  # not None and not 0 rows (0 images)


def check_same_inputs(names: list[str], bound: dict, modules: list[str]) -> None:
    """Every rank was given the same of the released forward's arguments `names`, or every rank raises the same
    error naming the arguments, the ranks and the fix."""

    mine = [[int(given(bound.get(name))) for name in names]]
    everyone = [rows[0] for rows in all_gather_host(mine, checkpoint_group())]
    differing = [name for i, name in enumerate(names) if len({rank[i] for rank in everyone}) > 1]
    if not differing:
        return
    have = [r for r, rank in enumerate(everyone) if rank[names.index(differing[0])]]
    lack = [r for r in range(len(everyone)) if r not in have]
    raise ValueError(
        f"adopted model: {differing} given on ranks {have} but not on ranks {lack} in this step. The released "
        f"model's forward skips the modules that read them where they are missing, and the sharded or replicated "
        f"modules {modules} would enter their collectives on some ranks only (a hang). Set group_by_modality: true "
        "(every global batch agrees on its modalities) or give every batch the same inputs (every rank raises this)")
