"""The boundary of a sequence-parallel module (`sequence.py`): the rest of the composed model is data parallel (each
rank its own rows, whole sequences), while the module's group runs the group's rows together, each rank on its
1 / N of the positions.

At the module's forward: each rank's sequence inputs (`input_ids` / `inputs_embeds` and every tensor with the same
rows and positions: `attention_mask`, `labels`, `position_ids`, ...) are padded to the group's longest sequence,
rounded up to a multiple of N, and exchanged so that rank j holds positions [j L / N, (j + 1) L / N) of the group's
rows in rank order (`sequence_exchange.RowsToChunks`, one all-to-all per tensor). Position ids are the global ones
(made where the call gives none; multimodal rotary positions, (axes, rows, positions), split along their
positions); `labels` are shifted before the split and passed as `shift_labels` too, so a loss the module computes
(transformers' `ForCausalLMLoss`) pairs each position with the next token even across chunks.
The outputs with the group's rows and this rank's positions go back to their rows' ranks, the padding cut off. A
module given `labels` whose loss is not transformers' `ForCausalLMLoss` (which reads `shift_labels`) is refused by
name: another loss would shift the shifted labels again.

A loss from `labels` over a global count (`num_items_in_batch`, Trainer's token count over every rank) is a sum
over the chunk's tokens: the ranks' losses add up to the group's, and FSDP2's average over the data and sequence
ranks gives one process's gradients. Without it, the module is given the group's label count / N as its count:
each rank reports N x (its chunk's sum) / (the group's count), whose mean over the group is the group's mean (one
process's when every rank holds as many label tokens), with no chunk dividing by zero labels.

Padding: on the right, a padded position never reaches an earlier one through causal attention, and its outputs
are cut off. Left padding (an `attention_mask` of zeros, then ones) is turned into right padding: each row is rotated
so its tokens come first, its position ids (given, or one process's 0 .. n - 1, pads counted) rotated with it, and
its outputs rotated back; each token then attends the same tokens at the same positions as in one process, whose
mask hides the pads. Refused by name on every rank: an `attention_mask` with a hole between tokens (packed
sequences), and a label on a left-padded row's first token (one process would predict it from a pad). Row
counts and lengths travel as host integers on a gloo group over the same ranks (`core.dist.host_group`); the mask
checks are read on the host at the first call and agreed by every rank, then kept on the device (`problem`: asked
before a checkpoint is written and at the run's end, where every rank raises what any found).
"""

from __future__ import annotations

import inspect

import torch
import torch.distributed as dist
from torch import nn

from ..core.dist import all_gather_host
from ..core.errors import OmniArgumentError
from .boundary import takes_use_cache
from .sequence_exchange import ChunksToRows, RowsToChunks

FIRST = ("inputs_embeds", "input_ids")
HOLE = ("an attention_mask with a hole between tokens (packed sequences) reached it: sequence parallelism serves left "
        "and right padding only")
FIRST_LABEL = ("a left-padded row has a label on its first token, which one process would predict from a padding "
               "position: set that label to -100 (a first token is never predicted)")
CAUSAL_LOSS = "ForCausalLMLoss"  # the loss that reads `shift_labels` (transformers' `loss_utils`)
PAD = {"labels": -100, "shift_labels": -100}  # other sequence tensors pad with 0 (position ids: continued)


class SequenceBoundary:
    """Hooks around a sequence-parallel module's forward; only the outermost call exchanges."""

    def __init__(self, module_name: str, mesh, key: str, host):
        """`host`: a gloo group over the same ranks (`core.dist.host_group`), for the row counts and lengths."""
        self.module_name, self.key, self.group, self.host = module_name, key, mesh.get_group(), host
        self.me, self.size = mesh.get_local_rank(), mesh.size()
        self.depth, self.state = 0, None
        self.checked, self.pending = False, None  # the masks' checks: read at the first call, then kept on the device

    def install(self, *modules: nn.Module) -> None:
        for module in modules:
            module.register_forward_pre_hook(self.before, with_kwargs=True)
            module.register_forward_hook(self.after, with_kwargs=True, always_call=True)
            module.hf_omni_pending_problem = self.problem  # what a checkpoint and the run's end ask before going on

    def problem(self) -> str | None:
        """What the masks since the last question broke (the group's, alike on its ranks): one host read, asked
        before a checkpoint is written and at the run's end, never per step."""
        pending, self.pending = self.pending, None
        reason = None if pending is None else mask_problem(pending.tolist())
        return None if reason is None else str(self.refuse(reason))

    def refuse(self, what: str) -> OmniArgumentError:
        return OmniArgumentError(self.module_name, self.key, what)

    def before(self, module, args, kwargs):
        self.depth += 1
        if self.depth > 1:
            return None
        self.state = None
        kwargs = as_keywords(module, args, kwargs)
        if kwargs.get("use_cache") is None and takes_use_cache(module):
            kwargs["use_cache"] = False  # a cache of the group's rows' chunks is no rank's
        rows, lengths, lead, padded = self._agree(kwargs)
        if "labels" in padded and getattr(getattr(module, "loss_function", None), "__name__", "") != CAUSAL_LOSS:
            raise self.refuse("it is given labels, but its loss is not transformers' causal-LM loss (ForCausalLMLoss, "
                              "which takes the labels shifted before the split as shift_labels): compute the loss "
                              "outside the module from its logits")
        chunks = {k: RowsToChunks.apply(v, self.group, rows, self.me) for k, v in padded.items()}
        if isinstance(kwargs.get("position_ids"), torch.Tensor) and kwargs["position_ids"].ndim == 3:
            chunks["position_ids"] = chunks["position_ids"].permute(2, 0, 1)  # back to (axes, rows, positions)
        if "labels" in chunks:
            chunks["shift_labels"] = chunks["labels"]
            if kwargs.get("num_items_in_batch") is None:
                count = (chunks["labels"] != -100).sum().float()
                dist.all_reduce(count, group=self.group)
                kwargs["num_items_in_batch"] = count / self.size
        self.state = (rows, lengths, lead)
        return (), {**kwargs, **chunks}

    def _agree(self, kwargs: dict) -> tuple[list[int], list[int], torch.Tensor | None, dict]:
        """Every rank's row count and length (one all-gather), then this rank's sequence tensors turned so that each
        row's left padding follows its tokens (`lead`: each row's left padding), padded to the group's length (a
        multiple of N), labels shifted, position ids made."""
        first = next((kwargs[k] for k in FIRST if isinstance(kwargs.get(k), torch.Tensor)), None)
        b, n = (first.shape[0], first.shape[1]) if first is not None and first.ndim >= 2 else (-1, -1)
        mask = kwargs.get("attention_mask")
        lead, flags = None, None
        if isinstance(mask, torch.Tensor) and mask.ndim == 2 and tuple(mask.shape) == (b, n):
            lead = (mask.long().cumsum(1) == 0).sum(1)  # on the device
            flags = torch.stack([bool_holes(turn(mask, lead)), torch.zeros((), dtype=torch.bool, device=lead.device)])
            labels = kwargs.get("labels")
            if isinstance(labels, torch.Tensor) and tuple(labels.shape[:2]) == (b, n):  # one process predicts a
                head = labels.gather(1, lead.clamp(max=n - 1)[:, None].to(labels.device))[:, 0]  # padded row's
                flags[1] = ((lead > 0) & (lead < n) & (head.to(lead.device) != -100)).any()  # first from a pad
            if not isinstance(kwargs.get("position_ids"), torch.Tensor):  # one process's: 0 .. n - 1, pads counted
                kwargs = {**kwargs, "position_ids": torch.arange(n, device=mask.device).expand(b, -1)}
        table = [rows[0] for rows in all_gather_host([[b, n, int(isinstance(kwargs.get("labels"), torch.Tensor)),
                                                       int(flags is not None)]], self.host)]  # host ints only
        if any(r[0] < 0 for r in table):
            raise self.refuse(f"rank {[r[0] for r in table].index(-1)} of its sequence-parallel group called it "
                              "without input_ids / inputs_embeds of (rows, positions)")
        if not self.checked or any(r[3] for r in table):
            self._check_masks(flags, first.device)
        if len({r[2] for r in table}) > 1:
            raise self.refuse("some ranks of its sequence-parallel group pass labels and others do not")
        length = -(-max(r[1] for r in table) // self.size) * self.size
        return [r[0] for r in table], [r[1] for r in table], lead, self._padded(kwargs, b, n, length, lead)

    def _check_masks(self, flags: torch.Tensor | None, device: torch.device) -> None:
        """The mask flags (a hole between tokens, a left-padded first token's label). At the first call: combined
        over every rank (the default group) and read on the host, so that a collator's habit is refused by every rank
        before anything trains. After it: combined over the group on the device (every rank of the group joins, with
        or without a mask) and kept there (`problem`)."""
        flags = (flags if flags is not None else torch.zeros(2, dtype=torch.bool, device=device)).to(torch.int32)
        if self.checked:
            dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.group)
            self.pending = flags if self.pending is None else torch.maximum(self.pending, flags)
            return
        self.checked = True
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)  # every rank's: a refusal is every rank's
        reason = mask_problem(flags.tolist())  # the first call's one host read
        if reason is not None:
            raise self.refuse(reason)

    def _padded(self, kwargs: dict, rows: int, n: int, length: int, lead: torch.Tensor | None) -> dict:
        out = {}
        for key, value in kwargs.items():
            if not isinstance(value, torch.Tensor) or value.ndim < 2 or key == "shift_labels":
                continue
            if key == "position_ids" and value.ndim == 3:  # (axes, rows, positions): multimodal rotary positions
                value = value.permute(1, 2, 0)  # rows and positions first, as every other sequence tensor
            elif key == "position_ids" and value.ndim > 3:
                raise self.refuse(f"its position_ids {tuple(value.shape)} are neither (rows, positions) nor (axes, "
                                  "rows, positions): sequence parallelism cannot split them")
            if key == "position_ids" and value.shape[0] == 1 and rows != 1:
                value = value.expand(rows, *value.shape[1:])
            if tuple(value.shape[:2]) != (rows, n):
                if value.shape[0] == rows:
                    raise self.refuse(f"its argument {key} {tuple(value.shape)} has one row per input row but not "
                                      f"one entry per position ({n}): sequence parallelism cannot split it")
                continue
            if lead is not None:  # each row's tokens first, its left padding after them (right padding)
                value = turn(value, lead)
            if key == "labels":  # shifted before the split: position t's label is token t + 1
                value = torch.cat([value[:, 1:], value.new_full((rows, 1), -100)], dim=1)
            out[key] = pad(value, length, PAD.get(key, 0), continued=key == "position_ids")
        if "position_ids" not in out:
            device = next(iter(out.values())).device
            out["position_ids"] = torch.arange(length, device=device).expand(rows, -1)
        return out

    def after(self, module, args, kwargs, output):
        try:
            return self._back(output, "output") if self.depth == 1 and self.state is not None else None
        finally:
            self.depth -= 1

    def _back(self, value, key: str):
        rows, lengths, lead = self.state
        if value is None or isinstance(value, (bool, int, float, str)):
            return value
        if isinstance(value, torch.Tensor):
            if value.ndim >= 2 and value.shape[0] == sum(rows):
                mine = ChunksToRows.apply(value, self.group, rows, self.me)[:, : lengths[self.me]]
                return mine if lead is None else turn(mine, lead, back=True)  # the left padding in front again
            if value.ndim == 0:  # a loss: each rank's share (the module docstring)
                return value
            raise self.refuse(f"its {key} {tuple(value.shape)} is neither per row and position nor a scalar: compute "
                              "it outside the module from its own rows")
        if isinstance(value, dict):  # ModelOutput too
            for name in list(value.keys()):
                value[name] = self._back(value[name], name)
            return value
        if isinstance(value, (tuple, list)):
            return type(value)(self._back(v, f"{key}[{i}]") for i, v in enumerate(value))
        raise self.refuse(f"its {key} is a {type(value).__name__}, which the sequence-parallel boundary cannot send "
                          "back to its rows (a cache: pass use_cache=False)")


def mask_problem(flags: list[int]) -> str | None:
    return HOLE if flags[0] else FIRST_LABEL if flags[1] else None


def turn(value: torch.Tensor, lead: torch.Tensor, back: bool = False) -> torch.Tensor:
    """Each row of `value` (rows, n, ...) rotated left by its `lead` positions (`back`: right), on the device."""
    n = value.shape[1]
    shift = -lead if back else lead
    index = (torch.arange(n, device=value.device)[None] + shift[:, None].to(value.device)) % n
    return value.gather(1, index.view(*index.shape, *[1] * (value.ndim - 2)).expand_as(value))


def bool_holes(mask: torch.Tensor) -> torch.Tensor:
    """Whether a 2-D attention mask has a 0 before a 1 in some row (left padding, holes): on the device."""
    on = mask.bool()
    return (~on[:, :-1] & on[:, 1:]).any() if on.shape[1] > 1 else torch.zeros((), dtype=torch.bool, device=on.device)


def pad(value: torch.Tensor, length: int, fill, continued: bool = False) -> torch.Tensor:
    """`value` (rows, n, ...) to (rows, length, ...): `fill`, or positions continued (position ids)."""
    extra = length - value.shape[1]
    if extra <= 0:
        return value
    if continued:
        steps = torch.arange(1, extra + 1, device=value.device).view(1, extra, *[1] * (value.ndim - 2))
        tail = value[:, -1:] + steps
    else:
        tail = value.new_full((value.shape[0], extra, *value.shape[2:]), fill)
    return torch.cat([value, tail], dim=1)


def as_keywords(module: nn.Module, args: tuple, kwargs: dict) -> dict:
    """A forward's positional arguments as keywords (by its signature), so every input is found by name."""
    if not args:
        return dict(kwargs)
    names = [p.name for p in inspect.signature(module.forward).parameters.values()
             if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return {**dict(zip(names, args)), **kwargs}
