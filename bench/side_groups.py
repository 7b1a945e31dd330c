"""hf_omni's side groups at 2, 4 and 8 gloo ranks: file descriptors each rank holds and the time to make them.

    python bench/side_groups.py

Per rank, each layout in fresh processes (plain `torch.distributed`, `RANK` / `WORLD_SIZE` as `torchrun` sets
them): open file descriptors (`/proc/self/fd`) after the default gloo group, after hf_omni's main-thread group
(`hf_omni.core.dist.checkpoint_group`) has carried an object collective, and after the async writer's; the seconds each
group took to make; then what an HSDP module's mesh (2 x world/2, `hf_omni.parallel.dims.Meshes`, with
`ddp_timeout` 1234 s, as the side groups) adds, the groups a rank is in, and the timeouts of hf_omni's groups. Run once with gloo's eager connection (torch's default) and once with `TORCH_GLOO_LAZY_INIT=1`
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
    from hf_omni.core.dist import checkpoint_group

    figures = {"default": fds()}
    for thread in ("main", "writer"):
        start = time.perf_counter()
        group = checkpoint_group(1234, thread)
        made = time.perf_counter() - start
        out = [None] * dist.get_world_size()
        dist.all_gather_object(out, dist.get_rank(), group=group)  # every pair of a ring and more
        dist.broadcast_object_list([0], src=0, group=group)
        figures[thread], figures[f"{thread}_s"] = fds(), made
    import torch

    from hf_omni.compat import group_timeout
    from hf_omni.parallel.dims import Meshes

    start = time.perf_counter()
    mesh = Meshes("cpu", 1234).get((2, dist.get_world_size() // 2))  # HSDP: a replicate and a shard group per rank
    for dim in mesh.mesh_dim_names:
        dist.all_reduce(torch.ones(1), group=mesh.get_group(dim))
    figures["mesh"], figures["mesh_s"] = fds(), time.perf_counter() - start
    groups = [dist.group.WORLD, checkpoint_group(), checkpoint_group(thread="writer")] + [
        mesh.get_group(dim) for dim in mesh.mesh_dim_names]
    figures["groups"] = len(groups)
    figures["timeouts"] = sorted({group_timeout(g, "cpu").total_seconds() for g in groups[1:]})
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
          "per group / (world - 1) | + an HSDP mesh (2 x world/2) | groups per rank | their timeouts, s "
          "| seconds to make (main, writer, mesh; worst rank) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for lazy in (False, True):
        for world in WORLDS:
            ranks = launch(world, lazy)
            worst = max(ranks, key=lambda r: r["writer"])
            added = max(r["writer"] - r["default"] for r in ranks) / 2
            print(f"| {'lazy' if lazy else 'eager'} | {world} | {worst['default']} | "
                  f"+{worst['main'] - worst['default']} "
                  f"| +{worst['writer'] - worst['main']} | {added / (world - 1):.2f} | "
                  f"+{max(r['mesh'] - r['writer'] for r in ranks)} | {worst['groups']} | {worst['timeouts']} | "
                  f"{max(r['main_s'] for r in ranks):.3f}, {max(r['writer_s'] for r in ranks):.3f}, "
                  f"{max(r['mesh_s'] for r in ranks):.3f} |")


if __name__ == "__main__":
    worker() if "--worker" in sys.argv else main()
