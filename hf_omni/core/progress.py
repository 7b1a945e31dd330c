"""Progress bars for hf_omni's long steps (checkpoint writes, exports, Hub pushes, offline encoding): transformers'
`tqdm`, so `transformers.utils.logging.disable_progress_bar()` and `HF_HUB_DISABLE_PROGRESS_BARS` silence them;
shown on the main process only."""

from __future__ import annotations

import os

from .dist import is_main


def progress(total: int, desc: str, unit: str = "module"):
    """A bar of `total` steps on the main process (a disabled one elsewhere, or when progress bars are off)."""
    from transformers.utils import logging

    off = not is_main() or os.environ.get("HF_HUB_DISABLE_PROGRESS_BARS", "").upper() in ("1", "ON", "YES", "TRUE")
    return logging.tqdm(total=total, desc=desc, unit=unit, disable=off or not logging.is_progress_bar_enabled(),
                        leave=False)


def each(items, desc: str, unit: str = "module", enabled: bool = True):
    """Iterate `items` with a bar (see `progress`); `enabled=False` (Trainer's `disable_tqdm`): no bar."""
    items = list(items)
    if not enabled:
        yield from items
        return
    with progress(len(items), desc, unit) as bar:
        for item in items:
            yield item
            bar.update(1)
