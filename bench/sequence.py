"""Sequence parallelism (`parallelism: {sp_size: N}`, Ulysses) at 4 gloo ranks on CPU: a Llama-shaped module at sp 1
(FSDP2 over 4), sp 2 (dp_shard 2 x sp 2) and sp 4, sequences of 1k and 4k tokens, one row per rank.

    python bench/sequence.py            # one 4-rank launch (torchrun); about 3 minutes on 2 cores

Per rank, for each layout and length: the bytes autograd saves for backward in the module's forward (every saved
tensor's storage counted once, `torch.autograd.graph.saved_tensors_hooks`) in all and per sequence (at sp N the
group runs N sequences, each rank 1 / N of each: its bytes per sequence are 1 / N of the total); the bytes its
all-to-alls send to other ranks in one step (forward and backward; `dist.all_to_all_single` wrapped) against the
theory (`theory`); the median step time (forward + backward, 3 steps after one warm-up); and the longest sequence
that fits the per-rank bytes sp 1 saves at 1k tokens (saved bytes are linear in the length: CPU sdpa's flash kernel
keeps no L x L matrix), sp N against sp 1. Then a Wan video transformer (hidden 128, 8 heads, 2 blocks) through
diffusers' own context parallelism at the same layouts, 1024 and 4096 latent tokens: saved bytes, step time and
the longest sequence (its all-to-alls are diffusers' functional collectives, not counted here).
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
WORLD = 4
SIZES, LENGTHS = (1, 2, 4), (1024, 4096)
SHAPE = dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=8,
             num_key_value_heads=4, max_position_embeddings=8192)


DIT_FRAMES = (4, 16)  # latent frames of 32 x 32, patches of 1 x 2 x 2: 1024 and 4096 tokens
DIT = dict(patch_size=(1, 2, 2), num_attention_heads=8, attention_head_dim=16, in_channels=16, out_channels=16,
           text_dim=32, freq_dim=256, ffn_dim=256, num_layers=2, cross_attn_norm=True, qk_norm="rms_norm_across_heads",
           rope_max_seq_len=1024)


def theory(sp: int, length: int) -> float:
    """Bytes one rank's all-to-alls send in a step: the boundary (input ids, labels and positions in, int64; the
    logits back, fp32, forward only: the loss is taken inside the module, no gradient comes back through them) and,
    per layer, q, k, v and the attention output each way (forward, then their gradients in backward, fp32),
    (N - 1) / N of each."""
    if sp == 1:
        return 0.0
    h, heads, kv = SHAPE["hidden_size"], SHAPE["num_attention_heads"], SHAPE["num_key_value_heads"]
    d = h // heads
    share = (sp - 1) / sp
    tokens = length  # per rank: its own row whole at the boundary, N rows x L / N positions inside
    boundary = 3 * tokens * 8 + tokens * SHAPE["vocab_size"] * 4  # ids, labels, positions; the logits
    layer = 2 * tokens * (2 * heads * d + 2 * kv * d) * 4  # q and output, k and v; forward and backward
    return share * (boundary + SHAPE["num_hidden_layers"] * layer)


def worker() -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import LlamaConfig, LlamaForCausalLM

    from hf_omni.compat import flatten_mesh
    from hf_omni.parallel.sequence import SequenceLayout

    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank = dist.get_rank()
    sent = [0]
    original = dist.all_to_all_single

    def counted(output, input, output_split_sizes=None, input_split_sizes=None, group=None, async_op=False):
        me, n = dist.get_rank(group), dist.get_world_size(group)
        splits = input_split_sizes or [input.shape[0] // n] * n
        row = input[0].numel() * input.element_size() if input.shape[0] else 0
        sent[0] += sum(s for i, s in enumerate(splits) if i != me) * row
        return original(output, input, output_split_sizes, input_split_sizes, group=group, async_op=async_op)

    dist.all_to_all_single = counted
    rows = []
    for sp in SIZES:
        for length in LENGTHS:
            torch.manual_seed(0)
            llm = LlamaForCausalLM(LlamaConfig(**SHAPE))
            mesh = init_device_mesh("cpu", (WORLD // sp, sp), mesh_dim_names=("dp_shard", "sp"))
            layout = SequenceLayout("llm", {"dp_shard_size": WORLD // sp, "sp_size": sp}) if sp > 1 else None
            if layout is not None:
                layout.check(llm)
                layout.apply(llm, mesh)
            fully_shard(llm, mesh=mesh[flatten_mesh(mesh, ("dp_shard", "sp"))])
            if layout is not None:
                layout.after_fsdp(llm, mesh, ())
            ids = torch.randint(0, SHAPE["vocab_size"], (1, length), generator=torch.Generator().manual_seed(rank))
            times, saved = [], 0
            for step in range(4):
                storages = {}

                def pack(t):
                    storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
                    return t

                sent[0] = 0
                start = time.perf_counter()
                with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                    loss = llm(input_ids=ids, labels=ids).loss
                loss.backward()
                times.append(time.perf_counter() - start)
                saved = sum(storages.values())
            rows.append((sp, length, saved, sent[0], statistics.median(times[1:])))
            del llm
    video = dit_rows(rank)
    every, videos = [None] * WORLD, [None] * WORLD
    dist.all_gather_object(every, rows)
    dist.all_gather_object(videos, video)
    if rank == 0:
        report(every)
        report_dit(videos)
    dist.destroy_process_group()


def dit_rows(rank: int) -> list:
    """A Wan video transformer through diffusers' own context parallelism: its saved bytes and step time at sp 1 / 2
    / 4 (one row per rank; the loss outside the module, on the rank's own rows), latents of FRAMES x 32 x 32."""
    import torch
    from diffusers import WanTransformer3DModel
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from hf_omni.compat import flatten_mesh
    from hf_omni.parallel.sequence import SequenceLayout

    rows = []
    for sp in SIZES:
        for frames in DIT_FRAMES:
            torch.manual_seed(0)
            model = WanTransformer3DModel(**DIT)
            mesh = init_device_mesh("cpu", (WORLD // sp, sp), mesh_dim_names=("dp_shard", "sp"))
            layout = SequenceLayout("transformer", {"dp_shard_size": WORLD // sp, "sp_size": sp}) if sp > 1 else None
            if layout is not None:
                layout.check(model)
                layout.apply(model, mesh)
            fully_shard(model, mesh=mesh[flatten_mesh(mesh, ("dp_shard", "sp"))])
            if layout is not None:
                layout.after_fsdp(model, mesh, ())
            g = torch.Generator().manual_seed(rank)
            x, e = torch.randn(1, 16, frames, 32, 32, generator=g), torch.randn(1, 16, DIT["text_dim"], generator=g)
            t = torch.rand(1, generator=g) * 1000
            times, saved = [], 0
            for step in range(4):
                storages = {}

                def pack(tensor):
                    storages[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
                    return tensor

                start = time.perf_counter()
                with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
                    out = model(hidden_states=x, timestep=t, encoder_hidden_states=e, return_dict=False)[0]
                out.square().mean().backward()
                times.append(time.perf_counter() - start)
                saved = sum(storages.values())
            rows.append((sp, frames * 16 * 16, saved, statistics.median(times[1:])))
            del model
    return rows


def report_dit(every: list) -> None:
    base = {tokens: r[2] for r in every[0] for tokens in [r[1]] if r[0] == 1}
    print()
    print("| layout | tokens | saved MiB / rank (max) | per sequence vs sp 1 | step s (median, spread over ranks) | "
          "step vs sp 1 | longest sequence at sp 1's bytes |")
    print("|---|---|---|---|---|---|---|")
    times1 = {}
    for i, (sp, tokens, _, _) in enumerate(every[0]):
        saved = max(r[i][2] for r in every)
        steps = [r[i][3] for r in every]
        step = statistics.median(steps)
        times1.setdefault(tokens, step) if sp == 1 else None
        first = min(base)
        longest = base[first] * sp * tokens / saved
        print(f"| Wan sp {sp} x dp {WORLD // sp} | {tokens} | {saved / 2**20:.1f} | {saved / sp / base[tokens]:.2f} | "
              f"{step:.3f} ({min(steps):.3f}-{max(steps):.3f}) | {step / times1[tokens]:.2f} | {longest:.0f} "
              f"({longest / first:.2f}x) |")


def report(every: list) -> None:
    base = {length: r[2] for r in every[0] for length in [r[1]] if r[0] == 1}
    print(f"| layout | tokens | saved MiB / rank (max) | per sequence vs sp 1 | all-to-all MiB / rank (max) | "
          f"vs theory | step s (median, spread over ranks) | step vs sp 1 | longest sequence at sp 1's bytes |")
    print("|---|---|---|---|---|---|---|---|---|")
    times1 = {}
    for i, (sp, length, _, _, _) in enumerate(every[0]):
        saved = max(r[i][2] for r in every)
        sent = max(r[i][3] for r in every)
        steps = [r[i][4] for r in every]
        step = statistics.median(steps)
        times1.setdefault(length, step) if sp == 1 else None
        per_sequence = saved / sp / base[length]
        expect = theory(sp, length)
        ratio = f"{sent / expect:.2f}" if expect else "-"
        longest = base[LENGTHS[0]] * sp * length / saved  # one sequence over the group, within sp 1's bytes at 1k
        print(f"| sp {sp} x dp {WORLD // sp} | {length} | {saved / 2**20:.1f} | {per_sequence:.2f} | "
              f"{sent / 2**20:.1f} | {ratio} | {step:.3f} ({min(steps):.3f}-{max(steps):.3f}) | "
              f"{step / times1[length]:.2f} | {longest:.0f} ({longest / LENGTHS[0]:.2f}x) |")


def main() -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(
        p for p in (os.path.dirname(HERE), os.environ.get("PYTHONPATH")) if p)}
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(WORLD),
                    "--master_port", "29633", os.path.abspath(__file__), "--worker"], check=True, env=env)


if __name__ == "__main__":
    worker() if "--worker" in sys.argv else main()
