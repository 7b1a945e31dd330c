"""hf_omni's side groups at 2, 4 and 8 gloo ranks: file descriptors each rank holds and the time to make them.

    python bench/side_groups.py

Per rank, each layout in fresh processes (plain `torch.distributed`, `RANK` / `WORLD_SIZE` as `torchrun` sets
them): open file descriptors (`/proc/self/fd`) after the default gloo group, after hf_omni's main-thread group
(`hf_omni.dist.checkpoint_group`) has carried an object collective, and after the async writer's; the seconds each
group took to make. Run once with gloo's eager connection (torch's default) and once with `TORCH_GLOO_LAZY_INIT=1`
(pairs connected on first use). A full-mesh gloo group holds world - 1 sockets per rank; the table shows what each
group adds, from which the docs give 512 ranks' needs.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

WORLDS = (2, 4, 8)


def fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def worker() -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    dist.barrier()
    from hf_omni.dist import checkpoint_group

    figures = {"default": fds()}
    for thread in ("main", "writer"):
        start = time.perf_counter()
        group = checkpoint_group(1800, thread)
        made = time.perf_counter() - start
        out = [None] * dist.get_world_size()
        dist.all_gather_object(out, dist.get_rank(), group=group)  # every pair of a ring and more
        dist.broadcast_object_list([0], src=0, group=group)
        figures[thread], figures[f"{thread}_s"] = fds(), made
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, figures)
    if dist.get_rank() == 0:
        print("RESULT " + json.dumps(everyone))
    dist.barrier()
    dist.destroy_process_group()


def launch(world: int, lazy: bool) -> list[dict]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": str(world)}
    if lazy:
        env["TORCH_GLOO_LAZY_INIT"] = "1"
    procs = [subprocess.Popen([sys.executable, __file__, "--worker"], env={**env, "RANK": str(r)},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(world)]
    outs = [p.communicate(timeout=600) for p in procs]
    if any(p.returncode for p in procs):
        raise SystemExit(f"bench/side_groups.py: world {world} failed:\n" + "\n".join(e[-3000:] for _, e in outs))
    line = next(line for line in outs[0][0].splitlines() if line.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


def main() -> None:
    print("| gloo connection | ranks | fds after the default group | + main-thread group | + writer group | "
          "per group / (world - 1) | seconds to make (main, writer; worst rank) |")
    print("|---|---|---|---|---|---|---|")
    for lazy in (False, True):
        for world in WORLDS:
            ranks = launch(world, lazy)
            worst = max(ranks, key=lambda r: r["writer"])
            added = max(r["writer"] - r["default"] for r in ranks) / 2
            print(f"| {'lazy' if lazy else 'eager'} | {world} | {worst['default']} | "
                  f"+{worst['main'] - worst['default']} "
                  f"| +{worst['writer'] - worst['main']} | {added / (world - 1):.2f} | "
                  f"{max(r['main_s'] for r in ranks):.3f}, {max(r['writer_s'] for r in ranks):.3f} |")


if __name__ == "__main__":
    worker() if "--worker" in sys.argv else main()
