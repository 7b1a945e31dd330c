"""An ordered checklist of checks run on every rank, one PASS / FAIL / NEEDS DEVICE line each (bench/gpu_check.py).

A check is a function registered with `@check(budget_s, cpu_note, needs=(...))` that returns `(ok, figure)`: `ok`
True / False, or None when running it showed that it needs a device. Every rank runs every check; rank 0 prints
the line once all ranks agree (over a gloo group of the script's own); a check past 4x its budget (20x on CPU) is
called hung and the process exits 1. `--bound SECONDS` bounds the whole run: a check whose budget no longer fits
is NOT RUN (the run exits 1), and the watchdog of a running one fires at the bound.
"""

from __future__ import annotations

import argparse
import functools
import gc
import os
import shutil
import sys
import threading
import time
import traceback

import torch

CUDA = torch.cuda.is_available()
RANK, WORLD = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
CHECKS = []  # (name, needs, budget in seconds, what its CPU run proves, function), in the order they run


def check(budget: int, cpu: str, needs: tuple = ()):
    """Register a check; `needs`: "cuda", "2 ranks", "4 ranks"."""
    return lambda fn: CHECKS.append((fn.__name__, needs, budget, cpu, fn)) or fn


def missing(needs: tuple) -> str | None:
    if "cuda" in needs and not CUDA:
        return "needs CUDA"
    for ranks in (2, 4):
        if f"{ranks} ranks" in needs and WORLD < ranks:
            return f"needs {ranks} ranks: torchrun --nproc_per_node {ranks} ({ranks} GPUs; gloo on CPU)"
    return None


@functools.cache
def gloo():
    """The script's own gloo group (made once a process group exists; every rank calls it in the same order)."""
    import torch.distributed as dist

    return dist.new_group(backend="gloo")


def gathered(result: tuple) -> list[tuple]:
    """Every rank's (ok, figure), over the script's gloo group (whatever a check left in the training group)."""
    import torch.distributed as dist

    if WORLD == 1 or not dist.is_initialized():
        return [result]
    out = [None] * WORLD
    dist.all_gather_object(out, result, group=gloo())
    return out


def run(name: str, budget: int, fn, left: float | None = None) -> tuple[str, float | None, str]:
    """(status, seconds, figure) of one check, agreed by every rank; a watchdog ends a hung check, and one that
    runs past the whole run's bound (`left`: seconds the run has left)."""
    def hung():
        why = "the run's bound" if limit == left else "a hang?"
        print(f"FAIL {name}: still running after {limit:.0f} s on rank {RANK} ({why}); stopping", flush=True)
        os._exit(1)
    limit, start = budget * (4 if CUDA else 20), time.perf_counter()
    limit = limit if left is None else min(limit, left)
    watchdog = threading.Timer(limit, hung)
    watchdog.daemon = True
    watchdog.start()
    try:
        ok, figure = fn()
    except Exception as err:  # noqa: BLE001 - one line per check, the rest still run
        traceback.print_exc()
        ok, figure = False, f"{type(err).__name__}: {(str(err).splitlines() or [''])[0]}"
    finally:
        watchdog.cancel()
    seconds = time.perf_counter() - start
    results = gathered((None if ok is None else bool(ok), str(figure)))
    gc.collect()
    if CUDA:
        torch.cuda.empty_cache()
    if all(r[0] is None for r in results):  # found out by running that it needs a device
        return "NEEDS DEVICE", seconds, results[0][1]
    if all(r[0] for r in results):
        return "PASS", seconds, results[0][1]
    failing = [f"rank {r}: {figure}" for r, (ok, figure) in enumerate(results) if not ok]
    return "FAIL", seconds, results[0][1] if len(results) == 1 else "; ".join(failing)


def main(doc: str, root: str) -> None:
    """`--only NAME ...`, `--list`; `root` (the checks' files) is cleared first. Exits 1 when a check failed."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--only", nargs="+", metavar="NAME", help="run these checks only")
    parser.add_argument("--list", action="store_true", help="list the checks and what they need; run nothing")
    parser.add_argument("--bound", type=float, metavar="SECONDS",
                        help="the whole run's bound: a check is not started when its budget no longer fits, and "
                             "the process exits 1 when a check runs past it")
    options = parser.parse_args()
    unknown = set(options.only or []) - {c[0] for c in CHECKS}
    if unknown:
        parser.error(f"unknown checks {sorted(unknown)}; the checks: {[c[0] for c in CHECKS]}")
    if options.list:
        for number, (name, needs, budget, cpu, _) in enumerate(CHECKS, 1):
            gpus = next((f"unverified: needs {n} GPUs" for n in (2, 4) if f"{n} ranks" in needs), "1 GPU")
            print(f"{number:2d}. {name:38s} {budget:3d} s  {gpus:24s} on CPU: {cpu}")
        return
    if RANK == 0:  # other ranks write nothing under root before their first collective with rank 0
        shutil.rmtree(root, ignore_errors=True)
        print(f"{sys.argv[0]}: {torch.cuda.get_device_name() if CUDA else 'CPU, no CUDA'}, {WORLD} rank(s), "
              f"torch {torch.__version__}", flush=True)
    counts, started = {"PASS": 0, "FAIL": 0, "NEEDS DEVICE": 0, "NOT RUN": 0}, time.perf_counter()
    for name, needs, budget, _, fn in CHECKS:
        if options.only and name not in options.only:
            continue
        why, left = missing(needs), None
        if options.bound is not None:  # every rank decides alike: the least time any rank has left
            left = min(r for r in gathered(options.bound - (time.perf_counter() - started)))
            if not why and left < budget:
                why = f"out of time: {left:.0f} s of the run's {options.bound:.0f} s left, its budget {budget} s"
        if why and why.startswith("out of time"):
            status, seconds, figure = "NOT RUN", None, why
        else:
            status, seconds, figure = ("NEEDS DEVICE", None, why) if why else run(name, budget, fn, left)
        counts[status] += 1
        if RANK == 0:
            shown = status + (" (cpu)" if status in ("PASS", "FAIL") and not CUDA else "")
            took = "      -" if seconds is None else f"{seconds:5.1f} s"
            late = f" (over its {budget} s budget)" if CUDA and seconds and seconds > budget else ""
            print(f"{shown:12s} {name:38s} {took}{late}  {figure}", flush=True)
    if RANK == 0:
        print(f"{counts['PASS']} passed, {counts['FAIL']} failed, {counts['NEEDS DEVICE']} need a device"
              + (f", {counts['NOT RUN']} not run (out of time)" if counts["NOT RUN"] else "")
              + f" ({time.perf_counter() - started:.0f} s)", flush=True)
    sys.exit(1 if counts["FAIL"] or counts["NOT RUN"] else 0)
