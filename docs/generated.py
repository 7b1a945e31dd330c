"""A generated section of a page: the text between two marker comments, rewritten by its generator's `--write`
and compared by the tests (docs/cli_reference.py, docs/compatibility.py, docs/errors.py)."""

from __future__ import annotations

import sys
from typing import Callable


def section(text: str, begin: str, end: str) -> str | None:
    """The part of `text` from `begin` to `end` (markers included), or None without them."""
    if begin not in text or end not in text:
        return None
    return text[text.index(begin):text.index(end) + len(end)]


def main(page: str, begin: str, end: str, make: Callable[[], str]) -> None:
    """`--write`: `make()` into `page` between the markers (appended with them where the page has none); else print
    it."""
    if "--write" not in sys.argv:
        print(make())
        return
    with open(page) as f:
        text = f.read()
    old = section(text, begin, end)
    with open(page, "w") as f:
        f.write(text.replace(old, make()) if old else text.rstrip() + "\n\n" + make() + "\n")
