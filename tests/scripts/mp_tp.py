"""Run under `accelerate launch --multi_gpu --num_processes N` (gloo, use_cpu): every tests/tp_scenarios.py scenario
for N ranks, in one launch. Usage: mp_tp.py OUT_DIR. Rank 0 writes OUT_DIR/<scenario>.pt: step losses, final full
weights, the llm's parameter placements, whether it recomputes (activation checkpointing), and the losses and final
weights of a run resumed from its checkpoint-2 (a model built from another seed); OUT_DIR/<scenario>/export: the
trained model's export (every rank its share of the llm's HF folder), OUT_DIR/<scenario>/checkpoint-2 its checkpoint.
Then each tp_scenarios.ELASTIC resume for N ranks (OUT_DIR/<name>.pt). At 2 ranks also OUT_DIR/empty_init_<name>.pt
(the tp2 and ep2 exports rebuilt with empty_init and trained at their layout) and OUT_DIR/ragged.pt: the boundary alone on ragged rows (rank r holds r + 1 rows) against one process, the largest
differences of the loss, every parameter's gradient and the input gradients. At 4 ranks also OUT_DIR/wan_dp2_sp2.pt:
a video diffusion transformer at dp_shard 2 x sp 2 (`wan_dp2_sp2`)."""

import copy
import os
import sys

import helpers
import torch
import torch.distributed as dist
import tp_scenarios
from ema_runs import ema_state

from hf_omni import OmniTrainer
from hf_omni.core.errors import OmniArgumentError
from launching import end_distributed
from transformers.integrations.fsdp import is_fsdp_managed_module


def main(out_dir: str):
    for name, (processes, _, _) in tp_scenarios.SCENARIOS.items():
        if processes != int(os.environ["WORLD_SIZE"]):
            continue
        model = tp_scenarios.model(name)
        trainer = OmniTrainer(model=model, args=tp_scenarios.args(os.path.join(out_dir, name), name,
                                                                  **tp_scenarios.save(name)),
                              train_dataset=helpers.tiny_data(model))
        trainer.train()
        placements = {key: str(p.placements) for key, p in model.llm.named_parameters()}
        trainer.save_model(os.path.join(out_dir, name, "export"))  # every rank its share of the llm's folder
        if name in tp_scenarios.LORAS:  # LoRA merged row by row on the ranks holding the rows
            model.save_pretrained(os.path.join(out_dir, name, "merged"), is_main_process=dist.get_rank() == 0,
                                  merge_lora=True)
        if name in tp_scenarios.GENERATE:  # each rank its own prompts through the trained split llm
            helpers.save_every_rank(tp_scenarios.generate(model.llm, dist.get_rank(), name),
                                    os.path.join(out_dir, f"{name}_generated.pt"))
        state = helpers.full_state(model)
        resumed = tp_scenarios.model(name, seed=7)  # every weight from the checkpoint
        again = OmniTrainer(model=resumed, args=tp_scenarios.args(os.path.join(out_dir, name + "_resumed"), name),
                            train_dataset=helpers.tiny_data(resumed))
        again.train(resume_from_checkpoint=os.path.join(out_dir, name, "checkpoint-2"))
        resumed_state = helpers.full_state(resumed)
        emas = (ema_state(model), ema_state(resumed))
        if dist.get_rank() == 0:
            torch.save({"losses": helpers.step_losses(trainer), "state": state, "placements": placements,
                        "checkpointing": model.llm.is_gradient_checkpointing,
                        "dtypes": sorted({str(p.dtype) for p in model.llm.parameters()}),
                        "managed": is_fsdp_managed_module(model.llm),
                        "save_async": trainer.plugin.checkpointer.save_async,
                        "resumed_losses": helpers.step_losses(again), "resumed": resumed_state,
                        "ema": emas[0], "resumed_ema": emas[1]},
                       os.path.join(out_dir, f"{name}.pt"))


def ragged(out_dir: str):
    """A tiny Llama split by tp 2 (FSDP2 over a dp_shard of 1) and its boundary; rank r runs its own r + 1 rows.
    Reference: the same model in this process on all rows, objective sum_r L_r / T (FSDP's average over ranks)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from hf_omni.parallel.tensor import TensorLayout
    from hf_omni.testing.host_reads import HostReads

    llm = tp_scenarios.tp_model().llm
    reference = copy.deepcopy(llm)
    torch.manual_seed(1)
    full = torch.randn(3, 5, llm.config.hidden_size)
    rank, world = dist.get_rank(), dist.get_world_size()
    mine = full[[0]] if rank == 0 else full[1:]
    mesh = init_device_mesh("cpu", (1, world), mesh_dim_names=("dp_shard", "tp"))
    layout = TensorLayout("llm", {"dp_shard_size": 1, "tp_size": world})
    layout.apply(llm, mesh)
    fully_shard(llm, mesh=mesh["dp_shard"])
    layout.after_fsdp(llm, mesh, ())
    x = mine.clone().requires_grad_()
    loss = llm(inputs_embeds=x, use_cache=False).logits.square().mean()
    loss.backward()
    xs = [full[[0]].clone().requires_grad_(), full[1:].clone().requires_grad_()]
    losses = [reference(inputs_embeds=r, use_cache=False).logits.square().mean() for r in xs]
    (sum(losses) / world).backward()
    grads = {name: p.grad.full_tensor() for name, p in llm.named_parameters() if p.grad is not None}  # not embeddings
    ref = dict(reference.named_parameters())
    diffs = {"loss": (loss - losses[rank]).abs().item(), "input": (x.grad - world * xs[rank].grad).abs().max().item(),
             "params": max((grads[n] - ref[n].grad).abs().max().item() for n in grads),
             "rows": tuple(x.shape), "grad_scale": ref["model.norm.weight"].grad.abs().max().item()}
    try:  # rank 1 alone gives no rows: every rank raises the refusal (none waits in the gather)
        llm(inputs_embeds=mine.clone() if rank == 0 else None, use_cache=False)
    except OmniArgumentError as err:
        diffs["refused"] = str(err)
    diffs["rows_after"] = tuple(llm(inputs_embeds=mine.clone(), use_cache=False).logits.shape)  # own rows again
    with HostReads() as reads, torch.no_grad():  # the row counts and shapes: host integers, no device read
        llm(inputs_embeds=mine.clone(), use_cache=False)
    diffs["host_reads"] = reads.found
    diffs.update(generated(llm, reference, rank))
    helpers.save_every_rank(diffs, os.path.join(out_dir, "ragged.pt"))


def sp_ragged(out_dir: str, name: str = "sp_ragged", kv_heads: int | None = None):
    """A tiny Llama at sp 2 (FSDP2 over dp_shard 1 x sp 2) and its boundary: rank r runs r + 1 rows of its own length
    (7 and 5 tokens: padded to 8 and split in 4 + 4), labels with ignored positions, Trainer's global token count.
    Reference: the same model in this process on every rank's rows, objective the sum of the ranks' losses. Then
    rank 1's rows left-padded (logits and loss as one process's with the mask; called again, no host read); a hole
    between tokens, and a left-padded first token's label, on rank 1 alone: kept on the device after the first call
    (both ranks report it when asked), refused at the first call; and `generate` is refused.
    `kv_heads`: the Llama with that many key/value heads instead (1: MQA, repeated for the 2 ranks)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import LlamaForCausalLM

    from hf_omni.compat import flatten_mesh
    from hf_omni.parallel.sequence import SequenceLayout
    from hf_omni.testing.host_reads import HostReads

    torch.manual_seed(0)
    llm = tp_scenarios.tp_model().llm
    if kv_heads is not None:
        llm.config.num_key_value_heads = kv_heads
        llm = LlamaForCausalLM(llm.config)
    reference = copy.deepcopy(llm)
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (1, world), mesh_dim_names=("dp_shard", "sp"))
    layout = SequenceLayout("llm", {"dp_shard_size": 1, "sp_size": world})
    layout.check(llm)
    layout.apply(llm, mesh)
    fully_shard(llm, mesh=mesh[flatten_mesh(mesh, ("dp_shard", "sp"))])
    layout.after_fsdp(llm, mesh, ("generate",))
    g = torch.Generator().manual_seed(1)
    ids = [torch.randint(3, llm.config.vocab_size, (r + 1, 7 - 2 * r), generator=g) for r in range(world)]
    labels = [i.clone() for i in ids]
    labels[0][:, :3] = -100  # rank 0's first positions: no loss (an image prefix)
    count = torch.tensor(sum(int((lab[:, 1:] != -100).sum()) for lab in labels))
    out = llm(input_ids=ids[rank], labels=labels[rank], num_items_in_batch=count)
    out.loss.backward()
    refs = [reference(input_ids=i, labels=lab, num_items_in_batch=count) for i, lab in zip(ids, labels)]
    sum(r.loss for r in refs).backward()
    total = out.loss.detach().clone()
    dist.all_reduce(total)
    ref = dict(reference.named_parameters())
    grads = {n: p.grad.full_tensor() * world for n, p in llm.named_parameters()}  # FSDP2's average: x N = the sum
    diffs = {"logits": (out.logits - refs[rank].logits).abs().max().item(), "shape": tuple(out.logits.shape),
             "loss": abs(total.item() - sum(r.loss.item() for r in refs)),
             "params": max((grads[n] - ref[n].grad).abs().max().item() for n in grads),
             "grad_scale": ref["model.norm.weight"].grad.abs().max().item()}
    # left padding on rank 1 (its rows' first 2 positions), its labels there ignored: as one process with the mask
    masks = [torch.ones_like(i) for i in ids]
    masks[1][:, :2] = 0
    padded = [lab.masked_fill(m == 0, -100) for lab, m in zip(labels, masks)]
    predicted = [lab.clone() for lab in padded]  # the first token's label kept: refused (one process would predict
    padded[1][:, 2] = -100                        # it from a pad)
    count = torch.tensor(sum(int((lab[:, 1:] != -100).sum()) for lab in padded))
    out = llm(input_ids=ids[rank], attention_mask=masks[rank], labels=padded[rank], num_items_in_batch=count)
    refs = [reference(input_ids=i, attention_mask=m, labels=lab, num_items_in_batch=count)
            for i, m, lab in zip(ids, masks, padded)]
    total = out.loss.detach().clone()
    dist.all_reduce(total)
    diffs["left_padded_logits"] = (out.logits - refs[rank].logits)[masks[rank].bool()].abs().max().item()
    diffs["left_padded_loss"] = abs(total.item() - sum(r.loss.item() for r in refs))
    with HostReads() as reads, torch.no_grad():  # after the first call: no device memory read on the host
        llm(input_ids=ids[rank], attention_mask=masks[rank], labels=padded[rank], num_items_in_batch=count)
    diffs["host_reads"] = reads.found
    mask = torch.ones_like(ids[rank])
    if rank == 1:
        mask[:, 1] = 0  # a hole between tokens (packed sequences)
    # after the first call, a mask's problem is kept on the device and read when a checkpoint or the end asks
    llm(input_ids=ids[rank], attention_mask=mask)
    diffs["kept_hole"] = llm.hf_omni_pending_problem()
    llm(input_ids=ids[rank], attention_mask=masks[rank], labels=predicted[rank])
    diffs["kept_first_label"], diffs["kept_none"] = llm.hf_omni_pending_problem(), llm.hf_omni_pending_problem()
    boundary = llm.hf_omni_pending_problem.__self__

    def other_loss():
        causal, llm.loss_type = llm.loss_type, "ForMaskedLM"  # a loss that shifts nothing: the labels would be wrong
        try:
            llm(input_ids=ids[rank], labels=labels[rank])
        finally:
            llm.loss_type = causal

    for key, call in (("hole", lambda: llm(input_ids=ids[rank], attention_mask=mask)),
                      ("first_label", lambda: llm(input_ids=ids[rank], attention_mask=masks[rank],
                                                  labels=predicted[rank])),
                      ("generate", lambda: llm.generate(input_ids=ids[rank], max_new_tokens=2)),
                      ("other_loss", other_loss)):
        boundary.checked = False  # as at the first call with a mask: read there, refused at once
        try:
            call()
        except OmniArgumentError as err:
            diffs[key] = str(err)
    helpers.save_every_rank(diffs, os.path.join(out_dir, f"{name}.pt"))


def generated(llm, reference, rank: int) -> dict:
    """`generate` on the split Llama, rank r with its own r + 1 prompts (the KV cache of the group's rows), greedy and
    sampled (every rank seeded differently: the group samples from its first rank's seed), against one process's
    `generate` on every prompt (sampling from that seed)."""
    from hf_omni.parallel.boundary import draw_seed

    prompts = torch.randint(3, llm.config.vocab_size, (3, 4), generator=torch.Generator().manual_seed(2))
    rows = [0] if rank == 0 else [1, 2]
    kwargs = dict(max_new_tokens=6, min_new_tokens=6, pad_token_id=0)
    with torch.no_grad():
        greedy = llm.generate(input_ids=prompts[rows], do_sample=False, **kwargs)
        torch.manual_seed(10 + rank)
        sampled = llm.generate(input_ids=prompts[rows], do_sample=True, top_k=0, **kwargs)
        expected_greedy = reference.generate(input_ids=prompts, do_sample=False, **kwargs)[rows]
        torch.manual_seed(10)
        torch.manual_seed(draw_seed())
        expected_sampled = reference.generate(input_ids=prompts, do_sample=True, top_k=0, **kwargs)[rows]
    return {"greedy": greedy, "expected_greedy": expected_greedy, "sampled": sampled,
            "expected_sampled": expected_sampled}


def elastic(out_dir: str):
    """Each `tp_scenarios.ELASTIC` resume for this world size: another scenario's checkpoint-2 (written by an earlier
    launch or this one) resumed at another layout; rank 0 writes OUT_DIR/<name>.pt (losses, final full weights, a
    split layer's placements)."""
    for name, (processes, source, _, _) in tp_scenarios.ELASTIC.items():
        if processes != int(os.environ["WORLD_SIZE"]):
            continue
        model = tp_scenarios.model(name, seed=7)
        trainer = OmniTrainer(model=model, args=tp_scenarios.args(os.path.join(out_dir, name), name),
                              train_dataset=helpers.tiny_data(model))
        trainer.train(resume_from_checkpoint=os.path.join(out_dir, source, "checkpoint-2"))
        state = helpers.full_state(model)
        if dist.get_rank() == 0:
            torch.save({"losses": helpers.step_losses(trainer), "state": state,
                        "placements": {key: str(p.placements) for key, p in model.llm.named_parameters()}},
                       os.path.join(out_dir, f"{name}.pt"))


def empty_init(out_dir: str):
    """The tp2 and ep2 runs' exports rebuilt with `empty_init=True` (on meta: split, sharded, then each rank reads its
    boxes: experts by their ranges) and trained at their layout; rank 0 writes OUT_DIR/empty_init_<name>.pt (whether
    it was on meta, losses, final full weights)."""
    for name in EMPTY_INIT:
        model = tp_scenarios.RowLossCaptioner.from_pretrained(os.path.join(out_dir, name, "export"), empty_init=True)
        on_meta = all(p.is_meta for p in model.parameters())
        trainer = OmniTrainer(model=model, args=tp_scenarios.args(os.path.join(out_dir, "empty_init_" + name), name),
                              train_dataset=helpers.tiny_data(model))
        trainer.train()
        state = helpers.full_state(model)
        if dist.get_rank() == 0:
            torch.save({"on_meta": on_meta, "losses": helpers.step_losses(trainer), "state": state},
                       os.path.join(out_dir, f"empty_init_{name}.pt"))


EMPTY_INIT = [name for name in ("tp2", "ep2", "sp2") if name in tp_scenarios.SCENARIOS]


def wan_dp2_sp2(out_dir: str):
    """The tiny Wan pipeline (tests/diffusion_runs.py) with its video transformer sharded over 2 data x 2 sequence
    ranks (diffusers' Ulysses attention over each pair) and its blocks checkpointed, one row a rank: trained,
    exported, sampled."""
    from diffusion_runs import WAN_SP, run

    transformer = {**WAN_SP["transformer"], "parallelism": {"dp_shard_size": 2, "sp_size": 2},
                   "activation_checkpointing": True}  # diffusers' own: each block recomputed, split again
    result = run("wan", os.path.join(out_dir, "wan_dp2_sp2"), {**WAN_SP, "transformer": transformer}, batch=1,
                 resume=False)
    if dist.get_rank() == 0:
        torch.save(result, os.path.join(out_dir, "wan_dp2_sp2.pt"))
    dist.barrier()


if __name__ == "__main__":
    main(sys.argv[1])
    elastic(sys.argv[1])
    if int(os.environ["WORLD_SIZE"]) == 4:
        wan_dp2_sp2(sys.argv[1])
    if int(os.environ["WORLD_SIZE"]) == 2:
        empty_init(sys.argv[1])
    if int(os.environ["WORLD_SIZE"]) == 2:
        ragged(sys.argv[1])
        sp_ragged(sys.argv[1])
        sp_ragged(sys.argv[1], "sp_ragged_mqa", kv_heads=1)
    end_distributed()
