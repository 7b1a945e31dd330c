"""The GPU checklist's runner where no GPU is: the whole run's bound (`bench/checklist.py --bound`) and the wheels
a machine without network is sent (`bench/gpu_wheels.py`, its resolution against a fake index, no network)."""

import os
import subprocess
import sys
import zipfile

import pytest

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench")

CHECKS = """
import sys, time
sys.path.insert(0, {bench!r})
import checklist
from checklist import check, main

@check(1, "quick")
def quick():
    return True, "ok"

@check({second_budget}, "slow")
def slow():
    time.sleep({second_sleep})
    return True, "slept"

@check(1, "after")
def after():
    return True, "ran"

main("checks\\n", {root!r})
"""


def run_checks(tmp_path, bound: float, second_budget: int, second_sleep: float):
    script = tmp_path / "checks.py"
    script.write_text(CHECKS.format(bench=BENCH, root=str(tmp_path / "root"), second_budget=second_budget,
                                    second_sleep=second_sleep))
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    return subprocess.run([sys.executable, str(script), "--bound", str(bound)], capture_output=True, text=True,
                          env=env, timeout=60)


def test_a_check_whose_budget_no_longer_fits_is_not_run_and_the_run_fails(tmp_path):
    done = run_checks(tmp_path, bound=30, second_budget=100, second_sleep=0)
    lines = done.stdout.splitlines()
    assert any(line.startswith("PASS") and " quick " in line for line in lines), done.stdout
    assert any(line.startswith("NOT RUN") and " slow " in line and "its budget 100 s" in line for line in lines)
    assert any(line.startswith("PASS") and " after " in line for line in lines)  # a later one that fits still runs
    assert "2 passed, 0 failed, 0 need a device, 1 not run (out of time)" in done.stdout
    assert done.returncode == 1


def test_a_check_running_past_the_bound_ends_the_run_at_the_bound(tmp_path):
    """Budget 5 s (its own watchdog would wait 100 s on a CPU): the run's bound of 3 s stops it."""
    done = run_checks(tmp_path, bound=3, second_budget=2, second_sleep=30)
    assert "FAIL slow: still running after" in done.stdout and "(the run's bound)" in done.stdout, done.stdout
    assert done.returncode == 1
    tail = done.stdout.split("FAIL slow")[1]
    assert "PASS" not in tail and "passed," not in tail  # the process ended there: no later check


def fake_wheel(folder, name: str, version: str, requires: list[str]) -> str:
    path = os.path.join(folder, f"{name.replace('-', '_')}-{version}-py3-none-any.whl")
    with zipfile.ZipFile(path, "w") as archive:
        meta = [f"Name: {name}", f"Version: {version}"] + [f"Requires-Dist: {r}" for r in requires]
        archive.writestr(f"{name.replace('-', '_')}-{version}.dist-info/METADATA", "\n".join(meta) + "\n")
    return path


def test_wheels_carry_what_the_machine_lacks_followed_to_the_end(tmp_path, monkeypatch):
    """The machine holds transformers 5.17 (below setup.cfg's range) and an old hub; accelerate, safetensors, ... it
    holds within range. Carried: the floor's transformers and peft (absent), then what they need that the machine
    lacks or holds outside the requirement (the hub, a new dependency `tiny-dep`); never torch."""
    sys.path.insert(0, BENCH)
    import gpu_wheels

    index = {"transformers": ("5.23.0", ["huggingface-hub<3.0,>=1.31.0", "tiny-dep>=1", "numpy>=1.17",
                                         "torch>=2.0", "tomli; python_version < '3.11'"]),
             "peft": ("0.21.2", ["transformers", "accelerate>=0.21.0", "torch>=1.13.0"]),
             "huggingface_hub": ("2.4.0", ["filelock>=3.10.0"]), "tiny-dep": ("1.2", []),
             "tomli": ("2.0", [])}
    asked = []

    def download(spec, folder, python):
        asked.append(spec)
        name = gpu_wheels.canonicalize_name(gpu_wheels.Requirement(spec).name)
        key = next(k for k in index if gpu_wheels.canonicalize_name(k) == name)
        return fake_wheel(folder, key, *index[key])

    monkeypatch.setattr(gpu_wheels, "download", download)
    have = tmp_path / "have.txt"
    have.write_text("transformers==5.17.0\nhuggingface-hub==1.33.0\naccelerate==1.15.0\nsafetensors==0.8.0\n"
                    "tokenizers==0.23.3\npyyaml==6.0.3\nscikit-learn==1.9.1\nnumpy==2.5.2\nfilelock==3.20.0\n"
                    "torch==2.11.0\n")
    monkeypatch.setattr(sys, "argv", ["gpu_wheels.py", str(have), "--python-version", "3.12",
                                      "--dest", str(tmp_path / "whl")])
    gpu_wheels.main()
    assert asked == ["transformers==5.23.0", "peft==0.21.2", "huggingface_hub==2.4.0", "tiny-dep>=1"]
    assert sorted(os.listdir(tmp_path / "whl")) == sorted(
        ["transformers-5.23.0-py3-none-any.whl", "peft-0.21.2-py3-none-any.whl",
         "huggingface_hub-2.4.0-py3-none-any.whl", "tiny_dep-1.2-py3-none-any.whl"])


def test_wheels_refuse_two_versions_of_one_package(tmp_path, monkeypatch):
    sys.path.insert(0, BENCH)
    import gpu_wheels

    def download(spec, folder, python):
        name = gpu_wheels.Requirement(spec).name
        if name == "transformers":
            return fake_wheel(folder, "transformers", "5.23.0", ["peft>=9"])
        return fake_wheel(folder, name, "0.21.2", [])

    monkeypatch.setattr(gpu_wheels, "download", download)
    have = tmp_path / "have.txt"
    have.write_text("")
    monkeypatch.setattr(sys, "argv", ["gpu_wheels.py", str(have), "--dest", str(tmp_path / "whl")])
    with pytest.raises(SystemExit, match="peft 0.21.2 is carried, but peft>=9 is needed too"):
        gpu_wheels.main()
