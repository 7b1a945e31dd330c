"""Shared fixtures: launching N gloo ranks (`launching.py`), the environment and free ports of scripts a test starts
itself. The tests' own modules (`helpers`, `launching`, `scripts.*`) are importable through setup.cfg's
`pythonpath`; a launched script gets the same folder through PYTHONPATH."""

from __future__ import annotations

import pytest
from launching import free_port, launch, subprocess_env


@pytest.fixture(scope="session")
def launch_ranks():
    """`launch(script, *args, processes=2, timeout=600, env_extra=None)`."""
    return launch


@pytest.fixture(scope="session")
def script_env():
    """`subprocess_env(**extra)`, for scripts a test starts itself."""
    return subprocess_env


@pytest.fixture
def port() -> int:
    return free_port()
