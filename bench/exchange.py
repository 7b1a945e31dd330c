"""The missing-modality exchange per optimizer step at 2, 4 and 8 gloo ranks: once per forward against once per
accumulation window.

    python bench/exchange.py

Collectives only, in fresh processes (plain `torch.distributed`, `RANK` / `WORLD_SIZE` as `torchrun` sets them): a
model class with one entry point whose one input is `forward`'s argument (`encode(pixel_values)`, as
`tests/mixed_modality.py`'s captioner), one rank in two without an image. Per optimizer step of A micro-steps:

- per forward (a forward outside a window): A x (the exchange before `forward`, `forward_plan.share_forward`, and the
  entry point's agreement at its call, `exchange.agree`);
- per window (OmniTrainer, `OmniPlugin.agree_window`): `window.agree_window` of the A batches, and each forward
  taking its answer (`window.take`).

Each layout runs ROUNDS rounds of STEPS steps after WARMUP; the table gives the median step of each round (ms; the
worst rank's), the collectives on hf_omni's side group per step and the bytes a rank receives per step, counted by
`hf_omni.testing.collectives.ReceivedBytes` (ring model). The donor's row broadcast, the same in both, is left out.
"""

from __future__ import annotations

import json
import os
import socket
import statistics
import subprocess
import sys
import time
import types

WORLDS, MICRO_STEPS = (2, 4, 8), (1, 4)
ROUNDS, STEPS, WARMUP = 3, 200, 20


def worker() -> None:
    import torch
    import torch.distributed as dist

    from hf_omni import offline_encoder
    from hf_omni.core.dist import checkpoint_group
    from hf_omni.offline import exchange, window
    from hf_omni.offline.forward_plan import share_forward
    from hf_omni.testing.collectives import ReceivedBytes

    dist.init_process_group("gloo")

    class Captioner:  # what the exchange reads of an OmniModel: its entry points, forward, slots, prepared
        @offline_encoder(module="vision", inputs=["pixel_values"], output="image_features")
        def encode(self, pixel_values):
            return pixel_values

        def forward(self, input_ids, pixel_values=None, labels=None):
            return None

    model, spec = Captioner(), Captioner.encode.offline_encoder
    model.training, model.prepared = True, types.SimpleNamespace(device=torch.device("cpu"))
    model.slots = {"vision": types.SimpleNamespace(strategy=types.SimpleNamespace(collective=True),
                                                   is_offline=False)}
    image = {"pixel_values": torch.zeros(2, 3, 8, 8)} if dist.get_rank() % 2 == 0 else {}
    batch = {"input_ids": torch.zeros(2, 16, dtype=torch.long), **image}
    group = checkpoint_group(1234)

    def per_forward(a: int) -> None:
        for _ in range(a):
            share_forward(model, (), batch, [], [spec])
            exchange.agree(None)

    def per_window(a: int) -> None:
        window.agree_window(model, [batch] * a, size=a)
        for _ in range(a):
            assert window.take(model, (), batch, [], [spec]) is not None

    figures = {}
    for a in MICRO_STEPS:
        for name, step in (("forward", per_forward), ("window", per_window)):
            with ReceivedBytes(group=group) as counted:
                step(a)
            rounds = []
            for _ in range(ROUNDS):
                for _ in range(WARMUP):
                    step(a)
                times = []
                for _ in range(STEPS):
                    dist.barrier(group=group)
                    start = time.perf_counter()
                    step(a)
                    times.append(time.perf_counter() - start)
                rounds.append(statistics.median(times) * 1e3)
            figures[f"{name}/{a}"] = {"ms": rounds, "calls": sum(counted.calls.values()), "bytes": counted.total}
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, figures)
    if dist.get_rank() == 0:
        print("RESULT " + json.dumps(everyone))
    dist.barrier()
    dist.destroy_process_group()


def launch(world: int) -> list[dict]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": str(world),
           "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, __file__, "--worker"], env={**env, "RANK": str(r)},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(world)]
    outs = [p.communicate(timeout=900) for p in procs]
    if any(p.returncode for p in procs):
        raise SystemExit(f"bench/exchange.py: world {world} failed:\n" + "\n".join(e[-3000:] for _, e in outs))
    line = next(line for line in outs[0][0].splitlines() if line.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


def main() -> None:
    print("| ranks | micro-steps a window | exchange | ms a step (median of each round, worst rank) | "
          "side-group collectives a step | bytes a rank receives a step |")
    print("|---|---|---|---|---|---|")
    for world in WORLDS:
        ranks = launch(world)
        for a in MICRO_STEPS:
            for name in ("forward", "window"):
                rows = [r[f"{name}/{a}"] for r in ranks]
                worst = [max(r["ms"][i] for r in rows) for i in range(ROUNDS)]
                print(f"| {world} | {a} | per {name} | {', '.join(f'{t:.3f}' for t in worst)} | "
                      f"{rows[0]['calls']} | {max(r['bytes'] for r in rows):.0f} |")


if __name__ == "__main__":
    worker() if "--worker" in sys.argv else main()
