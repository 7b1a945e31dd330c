"""The documentation site (docs/, Sphinx + MyST + autodoc) builds with warnings as errors: a broken link or anchor,
a page in no table of contents, a docstring autodoc cannot render fails it. The API reference names every public
name; the CLI reference is the parser's own help."""

import importlib.util
import os
import re

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


def test_the_cli_reference_is_the_parsers_help():
    spec = importlib.util.spec_from_file_location("cli_reference", os.path.join(DOCS, "cli_reference.py"))
    cli_reference = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cli_reference)
    with open(cli_reference.PAGE) as f:
        written = cli_reference.page_section(f.read())
    assert written == cli_reference.section(), "docs/cli.md is stale: python docs/cli_reference.py --write"


def test_the_versions_page_is_setup_cfg_and_the_constraints():
    spec = importlib.util.spec_from_file_location("compatibility", os.path.join(DOCS, "compatibility.py"))
    compatibility = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(compatibility)
    with open(compatibility.PAGE) as f:
        written = compatibility.page_table(f.read())
    assert written == compatibility.table(), "docs/compatibility.md is stale: python docs/compatibility.py --write"


def test_every_file_the_pages_cite_exists():
    """A path such as `hf_omni/modules/weights.py`, `bench/scale.py` or `examples/train.py` in the README or a
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


def test_the_refusals_catalogue_is_the_codes_own():
    spec = importlib.util.spec_from_file_location("errors", os.path.join(DOCS, "errors.py"))
    errors = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(errors)
    assert len(errors.refusals()) > 50  # the scan finds the raises (it reads every file of hf_omni/)
    with open(errors.PAGE) as f:
        written = errors.page_section(f.read())
    assert written == errors.catalogue(), "docs/troubleshooting.md is stale: python docs/errors.py --write"


def test_the_quickstart_page_is_the_notebook():
    spec = importlib.util.spec_from_file_location("quickstart", os.path.join(DOCS, "quickstart.py"))
    quickstart = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(quickstart)
    with open(quickstart.PAGE) as f:
        assert f.read() == quickstart.page(), "docs/quickstart.md is stale: python docs/quickstart.py --write"
