"""The versions CI tests are the ones the package claims: each floor `setup.cfg` states is what `constraints.txt`
pins (the first leg), `constraints-newest.txt` (the second leg) pins a release inside every range, and the README's
test command is the one `.ci/run` runs. The running leg's installed versions are one of the two."""

import configparser
import os
import re
from importlib.metadata import version

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def requirements() -> dict[str, Requirement]:
    cfg = configparser.ConfigParser()
    cfg.read(os.path.join(ROOT, "setup.cfg"))
    lines = cfg["options"]["install_requires"].split("\n")
    lines += [line for extra in cfg["options.extras_require"].values() for line in extra.split("\n")]
    reqs = [Requirement(line) for line in lines if line.strip()]
    return {canonical(r.name): r for r in reqs}


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def pins(file: str) -> dict[str, str]:
    out = {}
    for line in open(os.path.join(ROOT, file)):
        line = line.split("#")[0].strip()
        if line:
            name, pinned = line.split("==")
            out[canonical(name)] = pinned
    return out


def test_each_floor_is_the_version_the_first_leg_tests():
    floors, pinned = requirements(), pins("constraints.txt")
    for name, req in floors.items():
        lower = [s.version for s in req.specifier if s.operator == ">="]
        assert lower and name in pinned, f"{name}: no floor, or no pin in constraints.txt"
        assert Version(pinned[name]) == Version(lower[0]), f"{name}: floor {lower[0]} but tested {pinned[name]}"


def test_the_second_leg_pins_a_release_inside_every_range():
    ranges, newest, floors = requirements(), pins("constraints-newest.txt"), pins("constraints.txt")
    assert set(ranges) <= set(newest), sorted(set(ranges) - set(newest))
    for name, req in ranges.items():
        assert req.specifier.contains(newest[name]), f"{name}=={newest[name]} outside {req.specifier}"
        assert Version(newest[name]) >= Version(floors[name])
    assert newest["torch"] == floors["torch"]  # both legs on the CPU build of one torch


def test_the_readme_s_test_command_is_what_ci_runs():
    readme = open(os.path.join(ROOT, "README.md")).read()
    ci = open(os.path.join(ROOT, ".ci", "run")).read().replace("\\\n", " ")
    command = next(line for line in readme.splitlines() if "python -m pytest" in line and line.startswith("pip"))
    ci_command = next(line for line in ci.splitlines() if "python -m pytest" in line)
    quiet = {"-q"}  # CI's pip and pytest quieter; the same commands otherwise
    assert [w for w in ci_command.split() if w not in quiet] == [w for w in command.split() if w not in quiet]
    assert "constraints.txt" in command and "constraints-newest.txt" in command


@pytest.mark.parametrize("name", ["transformers", "accelerate", "torch"])
def test_this_run_is_on_one_of_the_two_legs(name):
    installed = version(name).split("+")[0]
    assert installed in (pins("constraints.txt")[name], pins("constraints-newest.txt")[name]), installed
