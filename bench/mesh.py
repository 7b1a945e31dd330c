"""Per-module meshes at 4 gloo ranks on CPU: the LLM fully sharded, HSDP 2 x 2, or replicated, side by side.

    python bench/mesh.py                  # three 4-rank launches, one per layout (fresh processes); ~3 minutes
    python bench/mesh.py --glibc-default  # the same without MALLOC_MMAP_THRESHOLD_=131072

The demo layout (frozen ViT, projector replicated at 3e-3, a Llama-style LLM that dominates) trained with
OmniTrainer, the LLM as `parallel: fsdp` on a (4,) mesh, as HSDP on a (dp_replicate=2, dp_shard=2) mesh, or as
`parallel: ddp`; ranks {0, 1} and {2, 3} play two "nodes". Per rank: peak RSS increase (ru_maxrss) over a baseline
taken once the process group is up, before the model is built (with MALLOC_MMAP_THRESHOLD_=131072: glibc otherwise
keeps FSDP's freed gather / reduce buffers, which lifts both sharded layouts past DDP at this size); the exact bytes
of LLM parameters + grads + AdamW state held (local shards, after an optimizer step); the median step time
(`StepTimer`); the bytes sent per step in collectives, over the same steps. gloo records no `record_param_comms`
profiler events in this torch, so a cheap wrapper counts: every `torch.distributed` collective is wrapped (FSDP2
calls `dist.all_gather_single` / `reduce_scatter_single` / `all_reduce`), and the DDP reducers (gloo from C++) get
torch's own `allreduce_hook` as comm hook, so their buckets pass through the wrapper too, tagged by module. Bytes
sent per rank, ring model, n = group size: all-gather out_bytes*(n-1)/n, reduce-scatter in_bytes*(n-1)/n,
all-reduce 2*bytes*(n-1)/n, broadcast bytes*(n-1)/n (per-rank mean of a pipelined broadcast): the collectives
issued, not gloo's own algorithms. A group inside {0, 1} or {2, 3} is "within a node", else "cross-node". LLM
traffic (FSDP2's calls, the LLM's DDP buckets) is apart from the rest (projector buckets, scalars); DTensor's
functional collectives (the grad norm's `full_tensor()`, a scalar) bypass the wrapper. Theory: see `theory`.
"""

from __future__ import annotations

import inspect
import json
import math
import os
import resource
import statistics
import subprocess
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))

WORLD, NODE = 4, 2  # ranks, ranks per "node"
WARMUP, STEPS, BATCH = 5, 30, 4
MODEL = dict(hidden=64, layers=2, llm_hidden=256, llm_layers=4)
LAYOUTS = {"full shard (4,)": {"parallel": "fsdp"},
           "HSDP 2x2": {"parallel": "fsdp", "parallelism": {"dp_replicate_size": 2, "dp_shard_size": 2}},
           "replicate (ddp)": {"parallel": "ddp"}}
# collective -> (the argument whose bytes count, ring factor of the group size n)
GATHER = SCATTER = BROADCAST = lambda n: (n - 1) / n  # noqa: E731
SPEC = {"all_gather_single": ("output_tensor", GATHER), "all_gather_into_tensor": ("output_tensor", GATHER),
        "all_gather": ("tensor_list", GATHER), "reduce_scatter_single": ("input", SCATTER),
        "reduce_scatter_tensor": ("input", SCATTER), "reduce_scatter": ("input_list", SCATTER),
        "all_reduce": ("tensor", lambda n: 2 * (n - 1) / n), "broadcast": ("tensor", BROADCAST)}
MIB = 2**20
MALLOC = {} if "--glibc-default" in sys.argv else {"MALLOC_MMAP_THRESHOLD_": "131072"}


class Traffic:
    """Wraps the collective functions of `torch.distributed`; counts bytes sent while `on`, by (owner, where)."""

    def __init__(self):
        self.on, self.sent, self.groups, self.local = False, {}, {}, threading.local()

    def install(self):
        import torch.distributed as dist
        import torch.distributed.distributed_c10d as c10d

        for name, (arg, ring) in SPEC.items():
            wrapped = self._wrap(getattr(c10d, name), arg, ring)
            setattr(c10d, name, wrapped)  # calls inside c10d (all_gather_object -> all_gather)
            setattr(dist, name, wrapped)  # `dist.all_gather_single(...)` in FSDP2

    def _wrap(self, fn, arg, ring):
        signature = inspect.signature(fn)

        def collective(*args, **kwargs):
            if not self.on or getattr(self.local, "depth", 0):  # a collective inside a counted one: counted once
                return fn(*args, **kwargs)
            bound = signature.bind(*args, **kwargs).arguments
            tensors = bound[arg] if isinstance(bound[arg], list) else [bound[arg]]
            ranks = self._ranks(bound.get("group"))
            caller = sys._getframe(1).f_code.co_filename
            owner = getattr(self.local, "tag", None) or ("llm" if "_fully_shard" in caller else "other")
            where = "within" if len({r // NODE for r in ranks}) == 1 else "cross"
            nbytes = sum(t.numel() * t.element_size() for t in tensors) * ring(len(ranks))
            self.sent[f"{owner}/{where}"] = self.sent.get(f"{owner}/{where}", 0.0) + nbytes
            self.local.depth = 1
            try:
                return fn(*args, **kwargs)
            finally:
                self.local.depth = 0

        return collective

    def _ranks(self, group) -> list[int]:
        import torch.distributed as dist

        group = group or dist.group.WORLD
        if group not in self.groups:
            self.groups[group] = dist.get_process_group_ranks(group)
        return self.groups[group]

    def ddp_hook(self, owner: str):
        """torch's default all-reduce as a comm hook, through the wrapped `dist.all_reduce`, tagged `owner`."""
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        def hook(group, bucket):
            self.local.tag = owner
            try:
                return allreduce_hook(group, bucket)
            finally:
                self.local.tag = None

        return hook


def local_bytes(tensors) -> int:
    from torch.distributed.tensor import DTensor

    return sum((t.to_local() if isinstance(t, DTensor) else t).nbytes for t in tensors if t is not None)


def theory(llm, layout: str, root_reshards: bool) -> dict[str, float]:
    """LLM bytes sent per rank per step, within / cross-node, and bytes held. The brief's model, from P: full shard
    over 4 = all-gather fwd + all-gather bwd (every unit reshards after forward) + reduce-scatter = 3 * 3/4 P =
    2.25P, all cross-node; HSDP 2x2 = the same over the 2 ranks of a node, 3 * 1/2 P = 1.5P, plus the cross-node
    all-reduce of the half shard over 2 ranks, 2 * 1/2 * P/2 = 0.5P; DDP = 2 * 3/4 P = 1.5P, cross-node. As run:
    FSDP2 pads each parameter's sharded dim to a multiple of the shard count (gathered / reduced sizes are padded;
    dim 0 unless hf_omni's placement rule picked another, which divides), and a
    root unit that keeps its parameters after forward (FSDP2's rule when reshard_after_forward is left None) skips
    its backward all-gather; hf_omni passes reshard_after_forward=True, so the root reshards and the 3 passes hold.
    Held: params + grads + 2 AdamW moments = 4 x the (padded) shard; DDP 4P (its reducer's buckets not counted)."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import Shard

    in_child = {id(p) for m in llm.modules() if m is not llm and isinstance(m, FSDPModule) for p in m.parameters()}
    params = list(llm.parameters())
    full = sum(p.numel() * 4 for p in params)
    if layout == "replicate (ddp)":
        return {"P": full, "brief/within": 0.0, "brief/cross": 1.5 * full, "run/within": 0.0, "run/cross": 1.5 * full,
                "state": 4 * full}
    shard = 4 if layout.startswith("full") else 2
    dims = {id(p): next(pl.dim for pl in p.placements if isinstance(pl, Shard)) for p in params}
    padded = {id(p): math.ceil(p.shape[dims[id(p)]] / shard) * shard * p.numel() // p.shape[dims[id(p)]] * 4
              for p in params}
    gathered = sum(padded.values())
    backward = sum(v for k, v in padded.items() if root_reshards or k in in_child)
    passes = (2 * gathered + backward) * (shard - 1) / shard  # all-gather fwd + bwd, reduce-scatter
    if shard == 4:
        return {"P": full, "brief/within": 0.0, "brief/cross": 2.25 * full, "run/within": 0.0, "run/cross": passes,
                "state": 4 * gathered / shard}
    return {"P": full, "brief/within": 1.5 * full, "brief/cross": 0.5 * full, "run/within": passes,
            "run/cross": 2 * (1 / 2) * gathered / shard, "state": 4 * gathered / shard}

def worker(layout: str):
    traffic = Traffic()
    traffic.install()  # before anything binds a collective by name
    import torch.distributed as dist
    from timing import StepTimer
    from torch.distributed._composable.replicate import replicate
    from torch.distributed.fsdp import FSDPModule
    from transformers import TrainerCallback

    from hf_omni import OmniTrainer, OmniTrainingArguments
    from hf_omni.testing.digits import build_model, build_tokenizer, load_splits

    modules = {"vision": {"trainable": False}, "projector": {"learning_rate": 3e-3},
               "llm": {"learning_rate": 1e-3, **LAYOUTS[layout]}}
    args = OmniTrainingArguments(
        output_dir="/tmp/hf_omni_bench/mesh", max_steps=WARMUP + STEPS, per_device_train_batch_size=BATCH,
        learning_rate=1e-3, lr_scheduler_type="constant", optim="adamw_torch", use_cpu=True, report_to="none",
        save_strategy="no", disable_tqdm=True, logging_steps=10_000, dataloader_drop_last=True, modules=modules)
    train_set, _ = load_splits(build_tokenizer())
    dist.barrier()  # the process group is up (args built it)
    baseline = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    timer, state_bytes = StepTimer(), {}

    class Probe(TrainerCallback):
        def on_train_begin(self, *a, **kw):
            for name, how in trainer.plugin.wrapped.items():
                if how == "ddp":  # composable replicate's DDP object: its reducer takes the hook
                    ddp = replicate.state(getattr(trainer.model, name))._ddp
                    ddp.register_comm_hook(ddp.process_group, traffic.ddp_hook(name if name == "llm" else "other"))

        def on_optimizer_step(self, args, state, control, **kw):
            if not state_bytes and state.global_step >= WARMUP:  # gradients and AdamW state both present
                llm, opt = trainer.model.llm, trainer.optimizer.optimizers["llm"]
                state_bytes.update(params=local_bytes(llm.parameters()), grads=local_bytes(
                    p.grad for p in llm.parameters()), optim=local_bytes(
                    t for s in opt.state.values() for t in s.values()))

        def on_step_end(self, args, state, control, **kw):
            traffic.on = WARMUP <= state.global_step < WARMUP + STEPS

    trainer = OmniTrainer(model=build_model(**MODEL), args=args, train_dataset=train_set,
                          callbacks=[timer.callback(), Probe()])
    trainer.train()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    mesh = trainer.plugin.meshes.get("llm")
    groups = {dim: dist.get_process_group_ranks(mesh.get_group(dim)) for dim in mesh.mesh_dim_names} if mesh else {}
    mine = dict(rss=peak - baseline, step=statistics.median(timer.measured(WARMUP)),
                sent={k: v / STEPS for k, v in traffic.sent.items()}, groups=groups, **state_bytes)
    ranks = [None] * dist.get_world_size()
    dist.all_gather_object(ranks, mine)
    if dist.get_rank() == 0:
        llm, reshards = trainer.model.llm, None
        if isinstance(llm, FSDPModule):  # FSDP2's own (private) record: does the root unit reshard after forward?
            reshards = llm._get_fsdp_state()._fsdp_param_group.post_forward_mesh_info is not None
        print("RESULT " + json.dumps(dict(ranks=ranks, theory=theory(llm, layout, bool(reshards)),
                                          root_reshards=reshards)))


def launch(layout: str) -> dict:
    cmd = ["accelerate", "launch", "--multi_gpu", "--num_processes", str(WORLD), "--num_machines", "1",
           "--mixed_precision", "no", "--dynamo_backend", "no", __file__, "--worker", layout]
    result = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1", **MALLOC})
    if result.returncode:
        sys.stderr.write(result.stdout[-3000:] + result.stderr[-6000:])
        raise SystemExit(f"bench/mesh.py --worker {layout!r} failed")
    line = next(line for line in result.stdout.splitlines() if line.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


def main():
    start = time.perf_counter()
    got = {layout: launch(layout) for layout in LAYOUTS}
    P = got["replicate (ddp)"]["theory"]["P"]
    allocator = " ".join(f"{k}={v}" for k, v in MALLOC.items()) or "glibc default allocator"
    print(f"bench/mesh.py, {WORLD} gloo ranks on CPU (OMP_NUM_THREADS=1, {allocator}), 'nodes' {{0,1}} and {{2,3}}; "
          f"LLM P = {P / MIB:.2f} MiB fp32; batch {BATCH}/rank; {STEPS} steps after {WARMUP} warm-up\n")
    print("| LLM layout | rank | peak RSS increase (MiB) | LLM params + grads + AdamW held (MiB) | median step (ms) | "
          "LLM sent/step within node (MiB) | LLM sent/step cross-node (MiB) | other sent/step within / cross (KiB) |")
    print("|---|---|---|---|---|---|---|---|")
    for layout, res in got.items():
        for rank, r in enumerate(res["ranks"]):
            s = r["sent"]
            held = f"{(r['params'] + r['grads'] + r['optim']) / MIB:.2f} ({r['params'] / MIB:.2f} + " \
                   f"{r['grads'] / MIB:.2f} + {r['optim'] / MIB:.2f})"
            print(f"| {layout} | {rank} | {r['rss'] / MIB:.0f} | {held} | {r['step'] * 1000:.0f} | "
                  f"{s.get('llm/within', 0) / MIB:.2f} | {s.get('llm/cross', 0) / MIB:.2f} | "
                  f"{s.get('other/within', 0) / 1024:.1f} / {s.get('other/cross', 0) / 1024:.1f} |")
    print("\n| LLM layout | mesh groups (ranks) | held: measured / theory 4P/shards (MiB) | sent/step within / cross: "
          "brief theory (P) | as run theory (P) | measured, mean of ranks (P) | measured / theory, brief / as run |")
    print("|---|---|---|---|---|---|---|")
    cross = {}
    for layout, res in got.items():
        t, ranks = res["theory"], res["ranks"]
        mean = {k: statistics.mean(r["sent"].get(f"llm/{k}", 0) for r in ranks) for k in ("within", "cross")}
        cross[layout] = (mean["cross"], t["run/cross"], t["brief/cross"])
        groups = {dim: sorted({tuple(r["groups"][dim]) for r in ranks}) for dim in ranks[0]["groups"]}
        mesh = "; ".join(f"{d}: {' '.join(str(list(g)) for g in gs)}" for d, gs in groups.items()) or "DDP: world"
        held = statistics.mean(r["params"] + r["grads"] + r["optim"] for r in ranks)
        ratio = {k: (mean["within"] + mean["cross"]) / (t[f"{k}/within"] + t[f"{k}/cross"]) for k in ("brief", "run")}
        print(f"| {layout} | {mesh} | {held / MIB:.2f} / {t['state'] / MIB:.2f} | "
              f"{t['brief/within'] / P:.3f} / {t['brief/cross'] / P:.3f} | {t['run/within'] / P:.4f} / "
              f"{t['run/cross'] / P:.4f} | {mean['within'] / P:.4f} / {mean['cross'] / P:.4f} | "
              f"{ratio['brief']:.4f} / {ratio['run']:.4f} |")
    full, hsdp = cross["full shard (4,)"], cross["HSDP 2x2"]
    print(f"\nCross-node bytes, full shard / HSDP 2x2: measured {full[0] / hsdp[0]:.3f}, as-run theory "
          f"{full[1] / hsdp[1]:.3f}, brief theory {full[2] / hsdp[2]:.3f}. FSDP root unit reshards after forward: "
          f"{got['full shard (4,)']['root_reshards']} (hf_omni passes reshard_after_forward=True).")
    print(f"\nTotal wall time: {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    if "--worker" in sys.argv:
        worker(sys.argv[sys.argv.index("--worker") + 1])
    else:
        main()
