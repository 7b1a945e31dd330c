"""The wheels a GPU machine without network lacks for the checklist, prepared where pip reaches the registry.

    # on the GPU machine, once (no network needed): what it has
    python3 -m pip list --format=freeze > have.txt
    # here, in the checkout (pip reaches the registry): the wheels it lacks, into the ignored folder .whl/
    python bench/gpu_wheels.py have.txt [--python-version 3.12]
    # on the GPU machine, with the checkout and its .whl/: install them aside, run the checklist, bounded
    bash bench/gpu_run.sh

What is carried: hf_omni's requirements (`REQUIRED`) that the machine lacks or holds outside setup.cfg's range,
at the versions `constraints.txt` pins (the CI floor), and every package their `Requires-Dist` needs that
`have.txt` lacks or holds outside the requirement, followed to the end (each at the newest version pip finds
within the requirement). Not carried: torch and its CUDA stack (the machine's own build is what the checklist
proves; a torch below the floor is named by gpu_run.sh, not replaced). A device call carries at most 64 MiB of
untracked files: the list printed at the end gives the size.
Wheels only (`--only-binary`), for the target's Python and manylinux x86_64.
"""

from __future__ import annotations

import argparse
import glob
import os
import re
import subprocess
import sys
import zipfile

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# what the checklist imports: setup.cfg's install_requires and the demo's extra, but torch and datasets (imported
# only to build offline caches, which no check does; with pyarrow it is over 60 MiB of wheels: `--also datasets`)
REQUIRED = ("transformers", "accelerate", "peft", "safetensors", "huggingface_hub", "pyyaml", "tokenizers",
            "scikit-learn")
NEVER = {"torch", "triton"}  # the machine's own CUDA build
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64",
             "manylinux1_x86_64")


def pins(path: str) -> dict[str, str]:
    """`name==version` lines of a freeze / constraints file, by canonical name."""
    out = {}
    for line in open(path):
        match = re.match(r"^\s*([A-Za-z0-9_.\-]+)\s*==\s*([^\s;#]+)", line)
        if match:
            out[canonicalize_name(match.group(1))] = match.group(2)
    return out


def allowed() -> dict[str, Requirement]:
    """setup.cfg's ranges (install_requires and the extras), by canonical name."""
    import configparser

    config = configparser.ConfigParser()
    config.read(os.path.join(ROOT, "setup.cfg"))
    lines = config["options"]["install_requires"].splitlines()
    lines += [line for key in config["options.extras_require"] for line in
              config["options.extras_require"][key].splitlines()]
    reqs = [Requirement(line.strip()) for line in lines if line.strip()]
    return {canonicalize_name(r.name): r for r in reqs}


def requirements_of(wheel: str, python: str) -> list[Requirement]:
    """A wheel's `Requires-Dist` that apply on the target (markers evaluated without extras)."""
    with zipfile.ZipFile(wheel) as archive:
        meta = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
        lines = archive.read(meta).decode().splitlines()
    env = {"python_version": python, "python_full_version": f"{python}.0", "platform_machine": "x86_64",
           "sys_platform": "linux", "platform_system": "Linux", "extra": ""}
    reqs = [Requirement(line.split(":", 1)[1].strip()) for line in lines if line.startswith("Requires-Dist:")]
    return [r for r in reqs if r.marker is None or r.marker.evaluate(env)]


def download(spec: str, folder: str, python: str) -> str:
    """One wheel for `spec`, no dependencies; its path."""
    before = set(glob.glob(os.path.join(folder, "*.whl")))
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "--python-version",
           python, "--implementation", "cp", "-d", folder, spec] + [a for p in PLATFORMS for a in ("--platform", p)]
    subprocess.run(cmd, check=True)
    new = set(glob.glob(os.path.join(folder, "*.whl"))) - before
    name = canonicalize_name(Requirement(spec).name)
    found = [w for w in new | before if canonicalize_name(os.path.basename(w).split("-")[0]) == name]
    if not found:
        raise SystemExit(f"gpu_wheels: pip found no wheel for {spec}")
    return sorted(found)[-1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("have", help="the GPU machine's `python3 -m pip list --format=freeze`")
    parser.add_argument("--python-version", default="3.12", help="the GPU machine's Python (major.minor)")
    parser.add_argument("--dest", default=os.path.join(ROOT, ".whl"), help="the ignored folder gpu_run.sh reads")
    parser.add_argument("--also", nargs="+", default=[], metavar="NAME", help="more pinned packages to carry")
    options = parser.parse_args()
    have, floor = pins(options.have), pins(os.path.join(ROOT, "constraints.txt"))
    os.makedirs(options.dest, exist_ok=True)
    for stale in glob.glob(os.path.join(options.dest, "*.whl")):  # one version of each: two stop the install
        os.remove(stale)
    carried: dict[str, str] = {}  # name -> version
    ranges = allowed()
    wanted = []
    for name in REQUIRED + tuple(options.also):  # the machine's own where setup.cfg allows it, else the floor
        key = canonicalize_name(name)
        mine = have.get(key)
        if mine is None or key not in ranges or not ranges[key].specifier.contains(Version(mine), prereleases=True):
            wanted.append(Requirement(f"{name}=={floor[key]}"))
    while wanted:
        req = wanted.pop(0)
        name = canonicalize_name(req.name)
        if name in NEVER:
            continue
        version = carried.get(name, have.get(name))
        if version is not None and (not req.specifier or req.specifier.contains(Version(version), prereleases=True)):
            continue
        if name in carried:
            raise SystemExit(f"gpu_wheels: {name} {carried[name]} is carried, but {req} is needed too")
        wheel = download(str(req), options.dest, options.python_version)
        carried[name] = os.path.basename(wheel).split("-")[1]
        wanted += requirements_of(wheel, options.python_version)
    size = sum(os.path.getsize(w) for w in glob.glob(os.path.join(options.dest, "*.whl")))
    print(f"gpu_wheels: {len(carried)} wheels, {size / 2**20:.1f} MiB in {options.dest}: "
          + ", ".join(f"{n} {v}" for n, v in sorted(carried.items())))
    if "torch" in have and Version(have["torch"].split("+")[0]) < Version(floor["torch"]):
        print(f"gpu_wheels: the machine's torch {have['torch']} is below the floor {floor['torch']}: not carried "
              "(a CUDA build is gigabytes); the checklist runs on it and says so")


if __name__ == "__main__":
    main()
