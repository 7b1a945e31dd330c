"""notebooks/quickstart.ipynb runs top to bottom in a fresh Jupyter kernel (its cells assert the accuracy, the
per-module logs, the reload of one module alone and the Hub round trip), writes nothing into the repository, and is
committed with its outputs stripped."""

import json
import os

import nbformat
from nbclient import NotebookClient

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTEBOOKS = os.path.join(ROOT, "notebooks")
QUICKSTART = os.path.join(NOTEBOOKS, "quickstart.ipynb")
SKIPPED = {".git", "__pycache__", ".pytest_cache"}


def repo_files() -> set:
    found = set()
    for base, dirs, names in os.walk(ROOT):
        dirs[:] = [d for d in dirs if d not in SKIPPED]
        found.update(os.path.relpath(os.path.join(base, n), ROOT) for n in names)
    return found


def test_quickstart_is_committed_stripped():
    nbformat.validate(nbformat.read(QUICKSTART, as_version=nbformat.NO_CONVERT))
    with open(QUICKSTART) as f:
        raw = json.load(f)
    assert raw["nbformat"] == 4 and raw["metadata"]["kernelspec"]["name"] == "python3"
    code = [cell for cell in raw["cells"] if cell["cell_type"] == "code"]
    assert code
    for cell in code:
        source = "".join(cell["source"])
        assert cell["outputs"] == [], f"outputs left in the cell starting {source[:60]!r}"
        assert cell["execution_count"] is None, f"execution count left in the cell starting {source[:60]!r}"


def test_quickstart_runs_top_to_bottom(tmp_path, monkeypatch):
    # The kernel inherits this environment: scratch files under tmp_path, no real Hub settings or token, and one
    # intra-op thread unless set (on a 2-core machine, 2 OpenMP threads are many times slower as soon as anything
    # else holds a core; one thread costs the quiet case a few seconds).
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setenv("OMP_NUM_THREADS", os.environ.get("OMP_NUM_THREADS", "1"))
    for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_TOKEN", "HF_ENDPOINT", "MPLBACKEND"):
        monkeypatch.delenv(name, raising=False)
    before = repo_files()
    nb = nbformat.read(QUICKSTART, as_version=4)
    NotebookClient(nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": NOTEBOOKS}}).execute()
    outputs = [o for cell in nb.cells if cell.cell_type == "code" for o in cell.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    images = [o for o in outputs if "image/png" in o.get("data", {})]
    assert len(images) == 3  # the training curves, the captioned digits and the drawn ones (inline backend)
    assert repo_files() == before  # everything went to a temporary folder,
    assert not [n for n in os.listdir(tmp_path) if n.startswith("hf_omni_quickstart_")]  # removed at the end
