"""The documentation site (docs/, Sphinx + MyST + autodoc) builds with warnings as errors: a broken link or anchor,
a page in no table of contents, a docstring autodoc cannot render fails it. The API reference names every public
name; the CLI reference is the parser's own help."""

import importlib.util
import os
import re

import pytest

import hf_omni

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = os.path.join(ROOT, "docs")


def test_the_site_builds_with_warnings_as_errors(tmp_path):
    from sphinx.cmd.build import build_main

    warnings = tmp_path / "warnings.txt"
    code = build_main(["-W", "--keep-going", "-E", "-q", "-b", "html", "-w", str(warnings), DOCS,
                       str(tmp_path / "html")])
    assert code == 0, warnings.read_text()
    assert (tmp_path / "html" / "api.html").exists() and (tmp_path / "html" / "index.html").exists()


def test_the_api_reference_documents_every_public_name():
    with open(os.path.join(DOCS, "api.md")) as f:
        text = f.read()
    documented = re.findall(r"^\.\. auto(?:class|function):: hf_omni\.(\w+)", text, flags=re.M)
    assert sorted(documented) == sorted(hf_omni.__all__)


def test_every_file_the_pages_cite_exists():
    """A path such as `hf_omni/files/weights.py`, `bench/scale.py` or `examples/train.py` in the README or a
    page names a file of the repository."""
    pages = [os.path.join(ROOT, "README.md")] + [os.path.join(DOCS, n) for n in os.listdir(DOCS) if n.endswith(".md")]
    missing = []
    for page in pages:
        with open(page) as f:
            text = f.read()
        for path in set(re.findall(r"\b((?:hf_omni|bench|examples|tests|docs|notebooks)/[\w/.-]+\.(?:py|md|yaml|sh|ipynb))",
                                   text)):
            if not os.path.exists(os.path.join(ROOT, path)):
                missing.append(f"{os.path.basename(page)}: {path}")
    assert missing == []


def generator(name: str):
    """docs/<name>.py, loaded as a module."""
    spec = importlib.util.spec_from_file_location(name, os.path.join(DOCS, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("name, make", [("cli_reference", "section"), ("compatibility", "table"),
                                        ("errors", "catalogue"), ("kinds", "tables"), ("parallelism_keys", "table"),
                                        ("layout_matrix", "table")])
def test_each_generated_section_is_what_its_generator_prints(name, make):
    """The CLI reference is the parser's own help, the versions page setup.cfg and both constraints files, the
    refusals catalogue every raise in hf_omni/ (the scan finds more than 50), the kinds' tables the registries, the
    `parallelism` keys the layouts' declarations, the layout matrix those and the tests serving its cells."""
    module = generator(name)
    with open(module.PAGE) as f:
        written = module.generated.section(f.read(), module.BEGIN, module.END)
    assert written == getattr(module, make)(), f"{module.PAGE} is stale: python docs/{name}.py --write"
    if name == "errors":
        assert len(module.refusals()) > 50


def test_the_quickstart_page_is_the_notebook():
    quickstart = generator("quickstart")
    with open(quickstart.PAGE) as f:
        assert f.read() == quickstart.page(), "docs/quickstart.md is stale: python docs/quickstart.py --write"
