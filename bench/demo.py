"""The demos' figures: held-out caption accuracy and training time over three seeds, each run a fresh process.

    python bench/demo.py [--seeds 0 1 2] [--only digits stage2 llava]

- `digits`: `python examples/train.py examples/configs/digits.yaml --seed S` (the README's demo);
- `stage2`: `python examples/train.py examples/configs/digits_stage2.yaml --seed S`, started from that seed's
  `digits` export (`init_from`), so it runs after `digits`;
- `llava`: `python examples/adopt_llava.py examples/configs/adopt_llava.yaml --seed S` (its release folder is
  written once to runs/tiny-llava-release with fixed weights; the seed moves the training);
- `read_and_draw`: `python examples/read_and_draw.py examples/configs/read_and_draw.yaml --seed S`: one model's
  held-out caption accuracy and the share of its drawings read as the prompted digit.
Outputs go under /tmp/hf_omni_bench. It reads the line each demo prints and prints a table per demo plus the
ranges. The machine and what else runs on it change the time, not the accuracy: say which when quoting it.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = "/tmp/hf_omni_bench"
LINE = re.compile(r"held-out caption accuracy[^:]*: ([0-9.]+)% \((\d+) images\) after (\d+) steps, (\d+) s of training")
DRAWN = re.compile(r"held-out caption accuracy: ([0-9.]+)% \((\d+) images\); drawn digits read as prompted: "
                   r"([0-9.]+)% \((\d+) drawings\); (\d+) s of training")
DEMOS = {  # name: (script, config, extra arguments given the seed)
    "digits": ("train.py", "digits.yaml", lambda s: ["--output_dir", f"{OUT}/demo_seed{s}"]),
    "stage2": ("train.py", "digits_stage2.yaml",
               lambda s: ["--init_from", f"{OUT}/demo_seed{s}", "--output_dir", f"{OUT}/stage2_seed{s}"]),
    "llava": ("adopt_llava.py", "adopt_llava.yaml",
              lambda s: ["--output_dir", f"{OUT}/llava_seed{s}"]),
    "read_and_draw": ("read_and_draw.py", "read_and_draw.yaml",
                      lambda s: ["--output_dir", f"{OUT}/read_and_draw_seed{s}"]),
}


def run(demo: str, seed: int) -> tuple:
    script, config, extra = DEMOS[demo]
    cmd = [sys.executable, os.path.join(ROOT, "examples", script), os.path.join(ROOT, "examples", "configs", config),
           "--seed", str(seed), "--disable_tqdm", "true", *extra(seed)]
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, check=True).stdout
    if demo == "read_and_draw":
        match = DRAWN.search(out)
        if match is None:
            raise SystemExit(f"bench/demo.py: {demo} seed {seed}: no score line in its output:\n{out[-2000:]}")
        row = (seed, float(match.group(1)), float(match.group(3)), int(match.group(5)))
        print(f"{demo} seed {seed}: captions {row[1]:.1f}%, drawings {row[2]:.1f}% after {row[3]} s", flush=True)
        return row
    match = LINE.search(out)
    if match is None:
        raise SystemExit(f"bench/demo.py: {demo} seed {seed}: no accuracy line in its output:\n{out[-2000:]}")
    row = (seed, float(match.group(1)), int(match.group(2)), int(match.group(3)), int(match.group(4)))
    print(f"{demo} seed {seed}: {row[1]:.1f}% after {row[4]} s", flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--only", nargs="+", choices=list(DEMOS), default=list(DEMOS))
    options = parser.parse_args()
    if "stage2" in options.only and "digits" not in options.only:
        missing = [s for s in options.seeds if not os.path.isfile(f"{OUT}/demo_seed{s}/config.json")]
        if missing:
            raise SystemExit(f"bench/demo.py: stage2 starts from the digits export of seeds {missing}: run digits too")
    results = {demo: [run(demo, seed) for seed in options.seeds] for demo in DEMOS if demo in options.only}
    for demo, rows in results.items():
        if demo == "read_and_draw":
            print(f"\n{demo}\n| seed | held-out captions | drawings read as prompted | training (s) |\n"
                  "|---|---|---|---|")
            for seed, accuracy, drawn, seconds in rows:
                print(f"| {seed} | {accuracy:.1f}% | {drawn:.1f}% | {seconds} |")
            print(f"{demo}: captions {min(r[1] for r in rows):.1f}–{max(r[1] for r in rows):.1f}%, drawings "
                  f"{min(r[2] for r in rows):.1f}–{max(r[2] for r in rows):.1f}%, training "
                  f"{min(r[3] for r in rows)}–{max(r[3] for r in rows)} s over {len(rows)} seeds")
            continue
        print(f"\n{demo}\n| seed | held-out accuracy | images | steps | training (s) |\n|---|---|---|---|---|")
        for seed, accuracy, images, steps, seconds in rows:
            print(f"| {seed} | {accuracy:.1f}% | {images} | {steps} | {seconds} |")
        accuracies, times = [r[1] for r in rows], [r[4] for r in rows]
        print(f"{demo}: accuracy {min(accuracies):.1f}–{max(accuracies):.1f}%, training {min(times)}–{max(times)} s "
              f"over {len(rows)} seeds")


if __name__ == "__main__":
    main()
