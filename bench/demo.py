"""The README's demo figure: held-out caption accuracy and training time over three seeds, each a fresh process.

    python bench/demo.py [--seeds 0 1 2]

Runs `python examples/train.py examples/configs/digits.yaml --seed S` (its output under /tmp), reads the line the
demo prints, and prints a table plus the range. The machine and what else runs on it change the time, not the
accuracy: say which when quoting it.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LINE = re.compile(r"held-out caption accuracy: ([0-9.]+)% \((\d+) images\) after (\d+) steps, (\d+) s of training")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    options = parser.parse_args()
    rows = []
    for seed in options.seeds:
        cmd = [sys.executable, os.path.join(ROOT, "examples", "train.py"),
               os.path.join(ROOT, "examples", "configs", "digits.yaml"), "--seed", str(seed),
               "--output_dir", f"/tmp/hf_omni_bench/demo_seed{seed}", "--disable_tqdm", "true"]
        out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, check=True).stdout
        match = LINE.search(out)
        if match is None:
            raise SystemExit(f"bench/demo.py: seed {seed}: no accuracy line in the demo's output:\n{out[-2000:]}")
        rows.append((seed, float(match.group(1)), int(match.group(2)), int(match.group(3)), int(match.group(4))))
        print(f"seed {seed}: {rows[-1][1]:.1f}% after {rows[-1][4]} s", flush=True)
    print("\n| seed | held-out accuracy | images | steps | training (s) |\n|---|---|---|---|---|")
    for seed, accuracy, images, steps, seconds in rows:
        print(f"| {seed} | {accuracy:.1f}% | {images} | {steps} | {seconds} |")
    accuracies, times = [r[1] for r in rows], [r[4] for r in rows]
    print(f"\naccuracy {min(accuracies):.1f}–{max(accuracies):.1f}%, training {min(times)}–{max(times)} s "
          f"over {len(rows)} seeds")


if __name__ == "__main__":
    main()
