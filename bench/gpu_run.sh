#!/usr/bin/env bash
# The GPU checklist where it is sent, in one command, bounded: installs the wheels bench/gpu_wheels.py prepared in
# the ignored .whl/ (if any) aside in /tmp/hf_omni_site, runs this checkout's hf_omni, and stops the whole run
# at BOUND seconds (default 540: the checklist's own --bound 30 s earlier, then `timeout`).
#   bash bench/gpu_run.sh                          # one GPU, the whole list
#   NPROC=2 bash bench/gpu_run.sh --only hsdp      # more ranks, some checks (arguments go to gpu_check.py)
set -euo pipefail
cd "$(dirname "$0")/.."
BOUND=${BOUND:-540}
NPROC=${NPROC:-1}
PYTHONPATH=$PWD
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/hf_omni_site \
    .whl/*.whl
  PYTHONPATH=/tmp/hf_omni_site:$PWD
fi
export PYTHONPATH PYTHONUNBUFFERED=1
python3 - <<'PY'
import importlib.metadata as md, re
from packaging.version import Version
floor = dict(re.match(r"([\w.-]+)==(\S+)", l).groups() for l in open("constraints.txt") if re.match(r"[\w.-]+==", l))
names = ["torch", "transformers", "accelerate", "peft", "safetensors", "huggingface_hub", "scikit-learn"]
found = {n: md.version(n) for n in names}
print("gpu_run: " + ", ".join(f"{n} {v}" for n, v in found.items()))
low = [f"{n} {v} < {floor[n]}" for n, v in found.items() if Version(v.split("+")[0]) < Version(floor[n])]
if low:
    print("gpu_run: below the CI floor (figures hold for these versions): " + ", ".join(low))
PY
exec timeout -k 15 "$BOUND" python3 -m torch.distributed.run --nproc_per_node "$NPROC" bench/gpu_check.py \
  --bound $((BOUND - 30)) "$@"
