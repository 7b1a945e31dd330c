"""docs/quickstart.md, generated from notebooks/quickstart.ipynb (its Markdown cells as they are, its code cells as
blocks the notebook runs: tests/test_notebook.py executes it; the page's snippet test takes them as its fragments):

    python docs/quickstart.py --write
tests/test_docs_site.py checks that the page is what this prints."""

from __future__ import annotations

import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTEBOOK = os.path.join(ROOT, "notebooks", "quickstart.ipynb")
PAGE = os.path.join(ROOT, "docs", "quickstart.md")
HEADER = ("<!-- generated from notebooks/quickstart.ipynb by docs/quickstart.py: edit the notebook, then "
          "python docs/quickstart.py --write -->")


def page() -> str:
    with open(NOTEBOOK) as f:
        cells = json.load(f)["cells"]
    out = [HEADER, ""]
    for cell in cells:
        source = "".join(cell["source"]).strip("\n")
        if not source:
            continue
        if cell["cell_type"] == "markdown":
            out += [source, ""]
        elif cell["cell_type"] == "code":
            out += ['<!-- skip: next "fragment of notebooks/quickstart.ipynb" -->', "```python", source, "```", ""]
    return "\n".join(out).rstrip() + "\n"


if __name__ == "__main__":
    if "--write" in sys.argv:
        with open(PAGE, "w") as f:
            f.write(page())
    else:
        print(page(), end="")
