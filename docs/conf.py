"""The documentation site: Sphinx with MyST (the pages stay Markdown that reads on GitHub) and autodoc (the API
reference from the docstrings). Built by tests/test_docs_site.py with warnings as errors.

Sphinx rather than MkDocs: it is released and maintained (MkDocs itself has had no release since 2024), autodoc
renders the package's docstrings without a plugin of its own, and MyST resolves `page.md#anchor` links at build
time, so a broken link fails the build."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

project = "hf_omni"
extensions = ["myst_parser", "sphinx.ext.autodoc"]
source_suffix = {".md": "markdown"}
exclude_patterns = ["_build"]
myst_heading_anchors = 3  # `page.md#a-heading` links resolve to headings of levels 1-3, and fail when missing
myst_enable_extensions = ["colon_fence"]
html_theme = "furo"
html_title = "hf_omni"
autodoc_member_order = "bysource"
autodoc_typehints = "description"
suppress_warnings = []
