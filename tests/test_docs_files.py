"""docs/how_it_works.md's table of files is the one docs/files_table.py generates from hf_omni/'s docstrings, and
every file of hf_omni/ has a module docstring saying what it is."""

import importlib.util
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _generator():
    spec = importlib.util.spec_from_file_location("files_table", os.path.join(ROOT, "docs", "files_table.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _rows(table: str) -> dict[str, str]:
    out = {}
    for line in table.splitlines():
        if line.startswith("| `"):
            path, job = line[2:-2].split(" | ", 1)
            out[path.strip("`")] = job
    return out


def test_every_file_has_a_docstring_saying_what_it_is():
    files_table = _generator()
    vague = {path: job for path, job in files_table.rows().items() if len(job.split()) < 4}
    assert not vague, f"files of hf_omni/ whose module docstring does not open with what the file is: {vague}"


def test_how_it_works_lists_every_file_with_its_job():
    files_table = _generator()
    with open(files_table.PAGE) as f:
        written = files_table.page_table(f.read())
    assert written is not None, f"docs/how_it_works.md lacks the markers {files_table.BEGIN!r} ... {files_table.END!r}"
    if written == files_table.table():
        return
    have, want = _rows(written), _rows(files_table.table())
    problems = [f"missing: {p}" for p in want if p not in have] + [f"extra: {p}" for p in have if p not in want]
    problems += [f"changed: {p}: {have[p]!r} -> {want[p]!r}" for p in want if p in have and have[p] != want[p]]
    problems = problems or ["rows in another order, or the header or markers differ"]
    raise AssertionError("docs/how_it_works.md's table of files is stale; regenerate it with "
                         f"`{files_table.COMMAND}`:\n" + "\n".join(problems))
