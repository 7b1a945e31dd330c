"""Per-module meshes at 4 gloo ranks on CPU: the LLM fully sharded, HSDP 2 x 2, replicated, tensor parallel 2 x
FSDP 2, and a MoE LLM fully sharded or expert parallel 2 x FSDP 4, side by side.

    python bench/mesh.py                  # six 4-rank launches, one per layout (fresh processes); ~6 minutes
    python bench/mesh.py --glibc-default  # the same without MALLOC_MMAP_THRESHOLD_=131072
    python bench/mesh.py --only "TP 2 x FSDP 2|MoE EP 2 x FSDP 4"  # some layouts (names joined by |)

The demo layout (frozen ViT, projector replicated at 3e-3, a Llama-style LLM that dominates) trained with
OmniTrainer, the LLM as `parallel: fsdp` on a (4,) mesh, as HSDP on a (dp_replicate=2, dp_shard=2) mesh, as
`parallel: ddp`, or as `parallelism: {dp_shard_size: 2, tp_size: 2}` (transformers' TP plan on `tp`, FSDP2 over
`dp_shard`; the loss taken outside the LM, `build`); then the same with a Qwen2-MoE LLM of the same width and depth
(`MOE`) fully sharded over 4 and as `parallelism: {dp_shard_size: 4, ep_size: 2}` (experts spread over `ep`, their
own FSDP2 unit over `efsdp`, the rest over all 4). Ranks {0, 1} and {2, 3} play two "nodes". Per rank: peak RSS
increase (ru_maxrss) over a baseline taken once the process group is up, before the model is built (with
MALLOC_MMAP_THRESHOLD_=131072: glibc otherwise keeps FSDP's freed gather / reduce buffers, which lifts both sharded
layouts past DDP at this size); the exact bytes of LLM parameters + grads + AdamW state held (local shards, after an
optimizer step); the median step time (`StepTimer`); the bytes sent per step in collectives, over the same steps.
gloo records no `record_param_comms` profiler events in this torch, so a cheap wrapper counts: every
`torch.distributed` collective is wrapped (FSDP2 calls `dist.all_gather_single` / `reduce_scatter_single` /
`all_reduce`; the TP boundary `dist.all_gather`; the EP split counts `dist.all_to_all_single`), the DDP reducers
(gloo from C++) get torch's own `allreduce_hook` as comm hook, so their buckets pass through the wrapper too, and
the functional collective ops (`torch.ops._c10d_functional.*`, which DTensor's redistributions in the TP styles
and transformers' token all-to-alls call, forward and backward) are wrapped as well. Bytes sent per rank, ring
model, n = group size: all-gather out_bytes*(n-1)/n, reduce-scatter in_bytes*(n-1)/n, all-reduce 2*bytes*(n-1)/n,
broadcast bytes*(n-1)/n (per-rank mean of a pipelined broadcast), all-to-all the input rows its split sizes send to
the other ranks: the collectives issued, as NCCL would send them, not gloo's own algorithms (nor torch's CPU
fallbacks, e.g. all-gather + chunk for an all-to-all). A group inside {0, 1} or {2, 3} is
"within a node", else "cross-node". LLM traffic by kind (`KINDS`: FSDP2's calls and the LLM's DDP buckets "dp", TP
activations "tp", the TP boundary "boundary", the EP all-to-alls "ep") is apart from the rest (projector buckets,
the grad norms' scalars and vectors). Theory: `theory` (the first three rows), `layout_theory` (the new ones).
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
           "replicate (ddp)": {"parallel": "ddp"},
           "TP 2 x FSDP 2": {"parallel": "fsdp", "parallelism": {"dp_shard_size": 2, "tp_size": 2}},
           "MoE full shard (4,)": {"parallel": "fsdp"},
           "MoE EP 2 x FSDP 4": {"parallel": "fsdp", "parallelism": {"dp_shard_size": 4, "ep_size": 2}}}
OLD = ("full shard (4,)", "HSDP 2x2", "replicate (ddp)")  # the demo Captioner (loss inside the LM)
# the MoE rows' LLM: a Qwen2-MoE of the demo LLM's width and depth (every layer sparse, a shared expert)
MOE = dict(layers=4, experts=8, top_k=2, moe_intermediate=256, shared_intermediate=256)
KINDS = ("dp", "tp", "boundary", "ep")  # LLM traffic: FSDP2 / DDP on parameters, TP activations, TP boundary, EP
# collective -> (the argument whose bytes count, ring factor of the group size n)
GATHER = SCATTER = BROADCAST = lambda n: (n - 1) / n  # noqa: E731
SPEC = {"all_gather_single": ("output_tensor", GATHER), "all_gather_into_tensor": ("output_tensor", GATHER),
        "all_gather": ("tensor_list", GATHER), "reduce_scatter_single": ("input", SCATTER),
        "reduce_scatter_tensor": ("input", SCATTER), "reduce_scatter": ("input_list", SCATTER),
        "all_reduce": ("tensor", lambda n: 2 * (n - 1) / n), "broadcast": ("tensor", BROADCAST),
        "all_to_all_single": ("input", None)}  # None: the rows its split sizes send to the other ranks
# DTensor's functional collectives (`torch.ops._c10d_functional`, forward and backward): op -> ring factor of the
# input's bytes (the group name is the last argument); all_to_all_single: the rows sent to other ranks
FUNCOL = {"all_reduce": lambda n: 2 * (n - 1) / n, "all_reduce_coalesced": lambda n: 2 * (n - 1) / n,
          "all_gather_into_tensor": lambda n: n - 1, "all_gather_into_tensor_coalesced": lambda n: n - 1,
          "reduce_scatter_tensor": SCATTER, "reduce_scatter_tensor_coalesced": SCATTER, "broadcast": BROADCAST,
          "all_to_all_single": None}
MIB = 2**20
MALLOC = {} if "--glibc-default" in sys.argv else {"MALLOC_MMAP_THRESHOLD_": "131072"}


def kind_of(caller: str) -> str:
    """Who issued a `torch.distributed` call, from the caller's file."""
    if "_fully_shard" in caller:
        return "dp"
    if caller.endswith(os.path.join("parallel", "boundary.py")):
        return "boundary"
    if "expert_parallel" in caller:
        return "ep"
    return "tp" if os.path.join("transformers", "distributed") in caller else "other"


def a2a_sent(tensor, splits, n: int, me: int) -> float:
    """Bytes an all-to-all sends to the other ranks: the rows its input split sizes give them (even: (n-1)/n)."""
    if not splits:
        return tensor.nbytes * (n - 1) / n
    return tensor.nbytes / max(tensor.shape[0], 1) * (sum(splits) - splits[me])


class Traffic:
    """Wraps the collective functions of `torch.distributed` and the functional collective ops that DTensor and
    transformers' all-to-all issue; counts bytes sent while `on`, by (kind, where): `kind_of`, `FunctionalOp`."""

    def __init__(self):
        self.on, self.sent, self.groups, self.local = False, {}, {}, threading.local()

    def install(self):
        import torch
        import torch.distributed as dist
        import torch.distributed.distributed_c10d as c10d

        for name, (arg, ring) in SPEC.items():
            wrapped = self._wrap(getattr(c10d, name), arg, ring)
            setattr(c10d, name, wrapped)  # calls inside c10d (all_gather_object -> all_gather)
            setattr(dist, name, wrapped)  # `dist.all_gather_single(...)` in FSDP2
        ops = torch.ops._c10d_functional
        for name, ring in FUNCOL.items():
            setattr(ops, name, FunctionalOp(self, name, getattr(ops, name), ring))
        import transformers.distributed.expert_parallel as ep  # binds `all_to_all_single` by name: after the wrap

        assert ep.all_to_all_single is dist.all_to_all_single

    def count(self, kind: str, ranks: list[int], nbytes: float) -> None:
        where = "within" if len({r // NODE for r in ranks}) == 1 else "cross"
        self.sent[f"{kind}/{where}"] = self.sent.get(f"{kind}/{where}", 0.0) + nbytes

    def _wrap(self, fn, arg, ring):
        signature = inspect.signature(fn)

        def collective(*args, **kwargs):
            if not self.on or getattr(self.local, "depth", 0):  # a collective inside a counted one: counted once
                return fn(*args, **kwargs)
            bound = signature.bind(*args, **kwargs).arguments
            tensors = bound[arg] if isinstance(bound[arg], list) else [bound[arg]]
            ranks = self._ranks(bound.get("group"))
            kind = getattr(self.local, "tag", None) or kind_of(sys._getframe(1).f_code.co_filename)
            if ring is None:
                import torch.distributed as dist

                nbytes = a2a_sent(tensors[0], bound.get("input_split_sizes"), len(ranks), ranks.index(dist.get_rank()))
            else:
                nbytes = sum(t.numel() * t.element_size() for t in tensors) * ring(len(ranks))
            self.count(kind, ranks, nbytes)
            self.local.depth = 1
            try:
                return fn(*args, **kwargs)
            finally:
                self.local.depth = 0

        return collective

    def _ranks(self, group) -> list[int]:
        import torch.distributed as dist
        import torch.distributed.distributed_c10d as c10d

        group = group or dist.group.WORLD
        if group not in self.groups:
            pg = c10d._resolve_process_group(group) if isinstance(group, str) else group
            self.groups[group] = dist.get_process_group_ranks(pg)
        return self.groups[group]

    def ddp_hook(self, kind: str):
        """torch's default all-reduce as a comm hook, through the wrapped `dist.all_reduce`, tagged `kind`."""
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        def hook(group, bucket):
            self.local.tag = kind
            try:
                return allreduce_hook(group, bucket)
            finally:
                self.local.tag = None

        return hook


class FunctionalOp:
    """A `torch.ops._c10d_functional` collective, counted, then run: DTensor's redistributions (and their backward),
    and transformers' token all-to-all, forward and backward, call these by attribute. Kind: an all-to-all is "ep",
    scalars and vectors (the grad norm's per-parameter norms) "other", the rest (activations) "tp"."""

    def __init__(self, traffic: Traffic, name: str, op, ring):
        self.traffic, self.name, self.op, self.ring = traffic, name, op, ring

    def __getattr__(self, attr):  # `.default` and the packet's other attributes
        return getattr(self.op, attr)

    def __call__(self, *args, **kwargs):
        traffic = self.traffic
        if traffic.on and not getattr(traffic.local, "depth", 0):
            import torch.distributed as dist

            tensors = args[0] if isinstance(args[0], (list, tuple)) else [args[0]]
            ranks = traffic._ranks(args[-1])
            if self.ring is None:
                nbytes, kind = a2a_sent(args[0], list(args[2]), len(ranks), ranks.index(dist.get_rank())), "ep"
            else:
                nbytes = sum(t.nbytes for t in tensors) * self.ring(len(ranks))
                kind = "other" if all(t.ndim <= 1 for t in tensors) else "tp"
            traffic.count(kind, ranks, nbytes)
        return self.op(*args, **kwargs)


def local_bytes(tensors) -> int:
    from torch.distributed.tensor import DTensor

    return sum((t.to_local() if isinstance(t, DTensor) else t).nbytes for t in tensors if t is not None)


def theory(llm, layout: str, root_reshards: bool) -> dict[str, float]:
    """LLM bytes sent per rank per step, within / cross-node, and bytes held. The textbook model, from P: full shard
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
        return {"P": full, "textbook/within": 0.0, "textbook/cross": 1.5 * full, "run/within": 0.0, "run/cross": 1.5 * full,
                "state": 4 * full}
    shard = 4 if layout.startswith("full") else 2
    dims = {id(p): next(pl.dim for pl in p.placements if isinstance(pl, Shard)) for p in params}
    padded = {id(p): math.ceil(p.shape[dims[id(p)]] / shard) * shard * p.numel() // p.shape[dims[id(p)]] * 4
              for p in params}
    gathered = sum(padded.values())
    backward = sum(v for k, v in padded.items() if root_reshards or k in in_child)
    passes = (2 * gathered + backward) * (shard - 1) / shard  # all-gather fwd + bwd, reduce-scatter
    if shard == 4:
        return {"P": full, "textbook/within": 0.0, "textbook/cross": 2.25 * full, "run/within": 0.0, "run/cross": passes,
                "state": 4 * gathered / shard}
    return {"P": full, "textbook/within": 1.5 * full, "textbook/cross": 0.5 * full, "run/within": passes,
            "run/cross": 2 * (1 / 2) * gathered / shard, "state": 4 * gathered / shard}


def shards(llm):
    """Per LLM parameter on this rank: (its full bytes, the bytes its FSDP all-gathers output here, whether its inner
    mesh dim (tp / ep) splits it, its data-parallel group). The inner split is torch's: ceil-sized chunks, this
    rank's by its mesh coordinate; FSDP2 then pads the sharded dim of that chunk to a multiple of its group size."""
    from torch.distributed.tensor import Shard

    out = []
    for p in llm.parameters():
        mesh, placements, shape = p.device_mesh, p.placements, list(p.shape)
        split = False
        for i, pl in enumerate(placements[1:], start=1):
            if isinstance(pl, Shard):
                n, chunk = shape[pl.dim], math.ceil(shape[pl.dim] / mesh.size(i))
                shape[pl.dim], split = max(0, min(chunk, n - mesh.get_local_rank(i) * chunk)), True
        dim, group = placements[0].dim, mesh.size(0)
        padded = math.ceil(shape[dim] / group) * group * math.prod(shape) // max(shape[dim], 1)
        out.append((p.numel() * p.element_size(), padded * p.element_size(), split, mesh.get_group(0)))
    return out


def layout_theory(llm, layout: str, seq: int, c: int) -> dict[str, float]:
    """The new rows' theory on this rank (rank 0 prints the mean over ranks), bytes per step by kind and where,
    "textbook" (two all-reduces each way per TP layer, no padding) and "run" (as run). T: tp size, S / efsdp:
    data-parallel group of a parameter, L layers,
    H hidden, V vocab, B rows per rank, seq tokens per row, A = T B x seq x H x 4 (a TP group's activations at one
    layer boundary); n-rank all-reduce sends 2(n-1)/n of its bytes, all-gather (n-1)/n of its output, reduce-scatter
    (n-1)/n of its input, all-to-all the rows for the other ranks.
    - dp, any layout: all-gather forward + backward + reduce-scatter over each parameter's data-parallel group,
      3 (S-1)/S x its all-gathered bytes per rank; textbook: a tp / ep split part P_split counts P_split / T
      (resp. / ep) unpadded, the rest P_repl whole; run: FSDP2's padded chunks of this rank's tp / ep chunk.
      Held: params + grads + 2 AdamW moments = 4 x the shards: 4 (P_split / (S T) + P_repl / S).
    - TP 2 x FSDP 2, tp: textbook: per layer 2 all-reduces of A forward (o_proj, down_proj outputs, Partial ->
      Replicate) and 2 backward (the colwise input grads), 4L x 2(T-1)/T x A. As run: the backward all-reduces one
      input grad per colwise layer (q, k, v, gate, up: 5 per layer) plus the lm_head's input grad, the forward
      all-gathers the lm_head's logits (colwise_gather_output, vocab padded to a multiple of T) and all-reduces the
      vocab-parallel embeddings' output (the group's caption tokens, c = 8 per row):
      (7L + 1) x 2(T-1)/T x A + (T-1)/T x T B x seq x ceil(V/T) T x 4 + 2(T-1)/T x T B x c x H x 4.
    - TP boundary: textbook: the inputs_embeds rows gathered (B seq H x 4 x (T-1)) and the logits' gradient rows
      (B seq V x 4 x (T-1)); as run also the input_ids the composed forward embeds (B x c x 8), the embeddings'
      output-gradient rows (B x c x H x 4), and 64 int64 of shape metadata per gathering call (2 per step).
    - EP, ep: per MoE layer, the dispatch and the combine all-to-alls forward and again backward, each sending
      k x B seq x H x 4 x (ep-1)/ep in expectation (uniform routing: each (token, expert) pair's expert on another
      rank with probability (ep-1)/ep); 4 L k B seq H x 4 (ep-1)/ep; the split-count all-to-alls (ints) are not in
      the theory. Dense part FSDP over 4, experts over efsdp: in dp above."""
    import torch.distributed as dist

    rows, cfg = BATCH, llm.config
    L, H, V = cfg.num_hidden_layers, cfg.hidden_size, cfg.vocab_size
    t = {"P": 0.0, "state/textbook": 0.0, "state/run": 0.0}
    t.update({f"{b}/{k}/{w}": 0.0 for b in ("textbook", "run") for k in KINDS for w in ("within", "cross")})
    for full, gathered, split, group in shards(llm):
        ranks = dist.get_process_group_ranks(group)
        n, inner = len(ranks), (WORLD // len(ranks) if split else 1)  # the inner dim's size: tp or ep
        where = "within" if len({r // NODE for r in ranks}) == 1 else "cross"
        t["P"] += full
        t[f"textbook/dp/{where}"] += 3 * (n - 1) / n * full / inner
        t[f"run/dp/{where}"] += 3 * (n - 1) / n * gathered
        t["state/textbook"] += 4 * full / inner / n
        t["state/run"] += 4 * gathered / n
    if "tp_size" in LAYOUTS[layout].get("parallelism", {}):
        T = LAYOUTS[layout]["parallelism"]["tp_size"]
        A = T * rows * seq * H * 4
        t["textbook/tp/within"] = 4 * L * 2 * (T - 1) / T * A
        t["run/tp/within"] = (7 * L + 1) * 2 * (T - 1) / T * A + (T - 1) / T * T * rows * seq * math.ceil(
            V / T) * T * 4 + 2 * (T - 1) / T * T * rows * c * H * 4
        t["textbook/boundary/within"] = (T - 1) * (rows * seq * H * 4 + rows * seq * V * 4)
        t["run/boundary/within"] = t["textbook/boundary/within"] + (T - 1) * (rows * c * 8 + rows * c * H * 4 + 2 * 64 * 8)
    if "ep_size" in LAYOUTS[layout].get("parallelism", {}):
        ep, k = LAYOUTS[layout]["parallelism"]["ep_size"], cfg.num_experts_per_tok
        t["textbook/ep/within"] = t["run/ep/within"] = 4 * L * k * rows * seq * H * 4 * (ep - 1) / ep
    return t


def build(layout: str):
    """The layout's composed model: the demo Captioner, or (new rows) the same pieces with the loss computed outside
    the LM (a tensor-parallel LM returns only its own rows), the MoE rows with a Qwen2-MoE LLM of the same width."""
    from hf_omni.testing.digits import Captioner, build_model

    base = build_model(**MODEL)
    if layout in OLD:
        return base
    import torch
    from transformers.modeling_outputs import CausalLMOutput

    class RowLossCaptioner(Captioner):
        def forward(self, input_ids, pixel_values=None, labels=None):
            prefix = self.projector(self.encode_image(pixel_values))
            embeds = torch.cat([prefix, self.llm.get_input_embeddings()(input_ids)], dim=1)
            logits = self.llm(inputs_embeds=embeds, use_cache=False).logits
            labels = torch.cat([labels.new_full(prefix.shape[:2], -100), labels], dim=1)
            loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten())
            return CausalLMOutput(loss=loss, logits=logits)

    modules = base.omni_modules()
    if layout.startswith("MoE"):
        from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

        llama = modules["llm"].config
        torch.manual_seed(0)
        modules["llm"] = Qwen2MoeForCausalLM(Qwen2MoeConfig(
            vocab_size=llama.vocab_size, hidden_size=llama.hidden_size, num_hidden_layers=MOE["layers"],
            num_attention_heads=4, num_key_value_heads=4, intermediate_size=4 * llama.hidden_size,
            moe_intermediate_size=MOE["moe_intermediate"], shared_expert_intermediate_size=MOE["shared_intermediate"],
            num_experts=MOE["experts"], num_experts_per_tok=MOE["top_k"], max_position_embeddings=64,
            pad_token_id=llama.pad_token_id, bos_token_id=llama.bos_token_id, eos_token_id=llama.eos_token_id))
    return RowLossCaptioner.from_modules(modules, processors=base.processors)


def worker(layout: str):
    traffic = Traffic()
    traffic.install()  # before anything binds a collective by name
    import torch.distributed as dist
    from timing import StepTimer
    from torch.distributed._composable.replicate import replicate
    from torch.distributed.fsdp import FSDPModule
    from transformers import TrainerCallback

    from hf_omni import OmniTrainer, OmniTrainingArguments
    from hf_omni.testing.digits import build_tokenizer, load_splits

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
                    ddp.register_comm_hook(ddp.process_group, traffic.ddp_hook("dp" if name == "llm" else "other"))

        def on_optimizer_step(self, args, state, control, **kw):
            if not state_bytes and state.global_step >= WARMUP:  # gradients and AdamW state both present
                llm, opt = trainer.model.llm, trainer.optimizer.optimizers["llm"]
                state_bytes.update(params=local_bytes(llm.parameters()), grads=local_bytes(
                    p.grad for p in llm.parameters()), optim=local_bytes(
                    t for s in opt.state.values() for t in s.values()))

        def on_step_end(self, args, state, control, **kw):
            traffic.on = WARMUP <= state.global_step < WARMUP + STEPS

    trainer = OmniTrainer(model=build(layout), args=args, train_dataset=train_set,
                          callbacks=[timer.callback(), Probe()])
    trainer.train()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    llm, groups = trainer.model.llm, {}
    for p in llm.parameters():  # every mesh the LLM's parameters live on (DDP: none)
        mesh = getattr(p, "device_mesh", None)
        for dim in mesh.mesh_dim_names if mesh is not None else ():
            groups[dim] = dist.get_process_group_ranks(mesh.get_group(dim))
    caption = len(train_set[0]["input_ids"])  # tokens per row: the caption's and the ViT's 16 patches and CLS
    mine = dict(rss=peak - baseline, step=statistics.median(timer.measured(WARMUP)),
                sent={k: v / STEPS for k, v in traffic.sent.items()}, groups=groups, **state_bytes,
                theory=None if layout in OLD else layout_theory(llm, layout, caption + (8 // 2) ** 2 + 1, caption))
    ranks = [None] * dist.get_world_size()
    dist.all_gather_object(ranks, mine)
    if dist.get_rank() == 0:
        reshards = None
        if isinstance(llm, FSDPModule):  # FSDP2's own (private) record: does the root unit reshard after forward?
            reshards = llm._get_fsdp_state()._fsdp_param_group.post_forward_mesh_info is not None
        if layout in OLD:
            t = theory(llm, layout, bool(reshards))
        else:  # the mean over ranks of each rank's own
            t = {k: statistics.mean(r["theory"][k] for r in ranks) for k in ranks[0]["theory"]}
        print("RESULT " + json.dumps(dict(ranks=ranks, theory=t, root_reshards=reshards)))


def launch(layout: str) -> dict:
    cmd = ["accelerate", "launch", "--multi_gpu", "--num_processes", str(WORLD), "--num_machines", "1",
           "--mixed_precision", "no", "--dynamo_backend", "no", __file__, "--worker", layout]
    result = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1", **MALLOC})
    if result.returncode:
        sys.stderr.write(result.stdout[-3000:] + result.stderr[-6000:])
        raise SystemExit(f"bench/mesh.py --worker {layout!r} failed")
    line = next(line for line in result.stdout.splitlines() if line.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


def llm_sent(r: dict, where: str) -> float:
    return sum(r["sent"].get(f"{kind}/{where}", 0.0) for kind in KINDS)


def main():
    start = time.perf_counter()
    only = sys.argv[sys.argv.index("--only") + 1].split("|") if "--only" in sys.argv else list(LAYOUTS)
    got = {layout: launch(layout) for layout in LAYOUTS if layout in only}
    allocator = " ".join(f"{k}={v}" for k, v in MALLOC.items()) or "glibc default allocator"
    sizes = ", ".join(f"{layout} {res['theory']['P'] / MIB:.2f}" for layout, res in got.items())
    print(f"bench/mesh.py, {WORLD} gloo ranks on CPU (OMP_NUM_THREADS=1, {allocator}), 'nodes' {{0,1}} and {{2,3}}; "
          f"LLM P (MiB fp32): {sizes}; batch {BATCH}/rank; {STEPS} steps after {WARMUP} warm-up\n")
    print("| LLM layout | rank | peak RSS increase (MiB) | LLM params + grads + AdamW held (MiB) | median step (ms) | "
          "LLM sent/step within node (MiB) | LLM sent/step cross-node (MiB) | other sent/step within / cross (KiB) |")
    print("|---|---|---|---|---|---|---|---|")
    for layout, res in got.items():
        for rank, r in enumerate(res["ranks"]):
            s = r["sent"]
            held = f"{(r['params'] + r['grads'] + r['optim']) / MIB:.2f} ({r['params'] / MIB:.2f} + " \
                   f"{r['grads'] / MIB:.2f} + {r['optim'] / MIB:.2f})"
            print(f"| {layout} | {rank} | {r['rss'] / MIB:.0f} | {held} | {r['step'] * 1000:.0f} | "
                  f"{llm_sent(r, 'within') / MIB:.2f} | {llm_sent(r, 'cross') / MIB:.2f} | "
                  f"{s.get('other/within', 0) / 1024:.1f} / {s.get('other/cross', 0) / 1024:.1f} |")
    old = [layout for layout in OLD if layout in got]
    if old:
        print("\n| LLM layout | mesh groups (ranks) | held: measured / theory 4P/shards (MiB) | sent/step within / "
              "cross: textbook theory (P) | as run theory (P) | measured, mean of ranks (P) | measured / theory, textbook / "
              "as run |")
        print("|---|---|---|---|---|---|---|")
    cross = {}
    for layout in old:
        res = got[layout]
        t, ranks, P = res["theory"], res["ranks"], res["theory"]["P"]
        mean = {k: statistics.mean(llm_sent(r, k) for r in ranks) for k in ("within", "cross")}
        cross[layout] = (mean["cross"], t["run/cross"], t["textbook/cross"])
        held = statistics.mean(r["params"] + r["grads"] + r["optim"] for r in ranks)
        ratio = {k: (mean["within"] + mean["cross"]) / (t[f"{k}/within"] + t[f"{k}/cross"]) for k in ("textbook", "run")}
        print(f"| {layout} | {mesh_groups(ranks)} | {held / MIB:.2f} / {t['state'] / MIB:.2f} | "
              f"{t['textbook/within'] / P:.3f} / {t['textbook/cross'] / P:.3f} | {t['run/within'] / P:.4f} / "
              f"{t['run/cross'] / P:.4f} | {mean['within'] / P:.4f} / {mean['cross'] / P:.4f} | "
              f"{ratio['textbook']:.4f} / {ratio['run']:.4f} |")
    if "full shard (4,)" in cross and "HSDP 2x2" in cross:
        full, hsdp = cross["full shard (4,)"], cross["HSDP 2x2"]
        print(f"\nCross-node bytes, full shard / HSDP 2x2: measured {full[0] / hsdp[0]:.3f}, as-run theory "
              f"{full[1] / hsdp[1]:.3f}, textbook theory {full[2] / hsdp[2]:.3f}. FSDP root unit reshards after "
              f"forward: {got['full shard (4,)']['root_reshards']} (hf_omni passes reshard_after_forward=True).")
    new = [layout for layout in got if layout not in OLD]
    if new:
        print("\nBy kind (dp: FSDP2 on parameters; tp: DTensor activations in the TP layers; boundary: the TP "
              "module's row gathers; ep: token all-to-alls and their split counts), sent per rank per step, mean "
              "of ranks, MiB, within / cross-node; theory: `layout_theory`\n")
        print("| LLM layout | mesh groups (ranks) | kind | measured | textbook theory | as run theory | "
              "measured / theory, textbook / as run |")
        print("|---|---|---|---|---|---|---|")
    for layout in new:
        t, ranks = got[layout]["theory"], got[layout]["ranks"]
        for kind in KINDS:
            m = {w: statistics.mean(r["sent"].get(f"{kind}/{w}", 0.0) for r in ranks) for w in ("within", "cross")}
            b, a = (sum(t[f"{x}/{kind}/{w}"] for w in ("within", "cross")) for x in ("textbook", "run"))
            if not (sum(m.values()) or a):
                continue
            pair = lambda x: f"{t[f'{x}/{kind}/within'] / MIB:.3f} / {t[f'{x}/{kind}/cross'] / MIB:.3f}"  # noqa: E731
            ratio = " / ".join(f"{sum(m.values()) / x:.4f}" if x else "-" for x in (b, a))
            print(f"| {layout} | {mesh_groups(ranks)} | {kind} | {m['within'] / MIB:.3f} / {m['cross'] / MIB:.3f} "
                  f"| {pair('textbook')} | {pair('run')} | {ratio} |")
        m = {w: statistics.mean(llm_sent(r, w) for r in ranks) for w in ("within", "cross")}
        b, a = (sum(t[f"{x}/{k}/{w}"] for k in KINDS for w in ("within", "cross")) for x in ("textbook", "run"))
        print(f"| {layout} | | all LLM | {m['within'] / MIB:.3f} / {m['cross'] / MIB:.3f} | {b / MIB:.3f} | "
              f"{a / MIB:.3f} | {sum(m.values()) / b:.4f} / {sum(m.values()) / a:.4f} |")
    if new:
        print("\n| LLM layout | P (MiB) | held per rank: measured, min–max of ranks (MiB) | textbook theory | as run "
              "theory (mean of ranks) | measured (mean) / as run |")
        print("|---|---|---|---|---|---|")
    for layout in new:
        t, ranks = got[layout]["theory"], got[layout]["ranks"]
        held = [r["params"] + r["grads"] + r["optim"] for r in ranks]
        print(f"| {layout} | {t['P'] / MIB:.2f} | {min(held) / MIB:.3f}–{max(held) / MIB:.3f} | "
              f"{t['state/textbook'] / MIB:.3f} | {t['state/run'] / MIB:.3f} | "
              f"{statistics.mean(held) / t['state/run']:.4f} |")
    if "MoE full shard (4,)" in got and "MoE EP 2 x FSDP 4" in got:
        full, ep = (got[x]["ranks"] for x in ("MoE full shard (4,)", "MoE EP 2 x FSDP 4"))
        f, e = ({w: statistics.mean(llm_sent(r, w) for r in x) for w in ("within", "cross")} for x in (full, ep))
        held = [statistics.mean(r["params"] + r["grads"] + r["optim"] for r in x) for x in (full, ep)]
        print(f"\nMoE, EP 2 x FSDP 4 against full shard (4,): cross-node bytes {e['cross'] / f['cross']:.3f}x, "
              f"within-node {e['within'] / MIB:.3f} against {f['within'] / MIB:.3f} MiB, all LLM bytes "
              f"{sum(e.values()) / sum(f.values()):.3f}x; held {held[1] / held[0]:.3f}x")
    print(f"\nTotal wall time: {time.perf_counter() - start:.0f} s")


def mesh_groups(ranks: list[dict]) -> str:
    groups = {dim: sorted({tuple(r["groups"][dim]) for r in ranks}) for dim in ranks[0]["groups"]}
    return "; ".join(f"{d}: {' '.join(str(list(g)) for g in gs)}" for d, gs in groups.items()) or "DDP: world"


if __name__ == "__main__":
    if "--worker" in sys.argv:
        worker(sys.argv[sys.argv.index("--worker") + 1])
        sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))
        from launching import end_distributed  # groups destroyed, then os._exit: gloo's teardown aborts now and then

        end_distributed()
    else:
        main()
