"""The row boundary of a layout whose group runs one batch together (tensor parallelism, `tensor.py`): the rest of
the composed model is data parallel over every rank (each its own rows), while the module's group must run one batch
together. So the ranks of one TP group gather their row inputs (the module runs once on the group's concatenated
rows) and each keeps its own rows of the row outputs.

Backward: transformers' styles assume the output gradient is the same on every rank of the group (their
`Partial -> Replicate` backward is local, norms are plain replicas), so `KeepRows`' backward gathers the rows'
gradients over the group, scaled by 1/T; `GatherRows`' backward is then a local slice, scaled back by T. FSDP's
average over the data-parallel dims then equals the mean over every rank's rows, as for a data-parallel module.
Ragged groups (ranks with different row counts) are exact; trailing dims must agree (a row tensor whose other dims
differ across the group is refused by name). A scalar the module computes over the group's rows (a causal LM's
loss from `labels`) is each rank's share: normalised by a global count (the call passes `num_items_in_batch`,
Trainer's token count over every rank) it is a sum over rows, and each rank reports 1/T of it, so that the ranks'
losses add up, and their gradients average, to one process's; otherwise it is a mean over the group's rows, which
each rank reports whole (one process's when every rank holds as many label tokens). Other outputs that are not one
row per input row (a cache) are refused by name. A forward taking `use_cache` is passed `use_cache=False` where it is
unset (a released model's forward calling its LLM).
"""

from __future__ import annotations

import contextlib
import functools
import inspect

import torch
import torch.distributed as dist
from torch import nn

from ..core.dist import all_gather_host
from ..core.errors import OmniArgumentError
from .sequence_exchange import all_to_all_rows

ROWS = ("inputs_embeds", "input_ids")  # what gives the rows where present (a (1, seq) position_ids does not)
NO_ROWS, TOO_MANY = -2, -3  # what a rank sends in place of its rows when it cannot describe them
SHAPES = 64  # ints of shape metadata each rank sends (rows, then each row tensor's dims)


def _gather(x: torch.Tensor, group, sizes: list[int]) -> torch.Tensor:
    """The group's rows of `x` in rank order (padded to the largest, so gloo's all_gather takes them)."""
    flag = x.dtype == torch.bool  # gloo gathers no bool
    x = x.to(torch.uint8) if flag else x
    pad = x.new_zeros((max(sizes), *x.shape[1:]))
    pad[: x.shape[0]] = x
    parts = [torch.empty_like(pad) for _ in sizes]
    dist.all_gather(parts, pad.contiguous(), group=group)
    out = torch.cat([p[:n] for p, n in zip(parts, sizes)])
    return out.bool() if flag else out


class GatherRows(torch.autograd.Function):
    """Forward: the group's rows. Backward: this rank's rows of the gradient, times T (every rank holds the same
    gradient: tensor parallelism), or, `partial`, the sum of every rank's gradient of them (each rank holds its part
    of it: diffusers' context parallelism), one all-to-all."""

    @staticmethod
    def forward(ctx, x, group, sizes, me, partial=False):
        ctx.lo, ctx.hi, ctx.T = sum(sizes[:me]), sum(sizes[: me + 1]), len(sizes)
        ctx.group, ctx.sizes, ctx.me, ctx.partial = group, sizes, me, partial
        return _gather(x, group, sizes)

    @staticmethod
    def backward(ctx, grad):
        if ctx.partial:
            mine = ctx.sizes[ctx.me]
            parts = all_to_all_rows(grad, [mine] * ctx.T, ctx.sizes, ctx.group)  # every rank's gradient of my rows
            return parts.unflatten(0, (ctx.T, mine)).sum(0), None, None, None, None
        return grad[ctx.lo: ctx.hi] * ctx.T, None, None, None, None


class KeepRows(torch.autograd.Function):
    """Forward: this rank's rows of the group's. Backward: every rank's row gradients gathered, over T (`partial`:
    whole, each rank's backward then reaches its part of the module)."""

    @staticmethod
    def forward(ctx, y, group, sizes, me, partial=False):
        ctx.group, ctx.sizes, ctx.partial = group, sizes, partial
        return y[sum(sizes[:me]): sum(sizes[: me + 1])].clone()

    @staticmethod
    def backward(ctx, grad):
        grad = _gather(grad.contiguous(), ctx.group, ctx.sizes)
        return (grad if ctx.partial else grad / len(ctx.sizes)), None, None, None, None


class Boundary:
    """Hooks around a split module's forward and its input embeddings' (which a composed forward calls
    first): only the outermost call gathers (the module's own call of its embeddings runs on gathered rows)."""

    def __init__(self, module_name: str, mesh, key: str, name: str, host, partial: bool = False):
        """`mesh`: the group's 1-D mesh; `key`: the setting errors name (the layout's `parallelism.<name>_size`);
        `name`: the group's, in messages (`tensor-parallel`); `host`: a gloo group over the same ranks
        (`core.dist.host_group`), for the row counts and shapes (no device memory is read on the host); `partial`:
        each rank's backward gives its part of the gradients (their sum over the group is the whole), not all of
        them (`GatherRows`)."""
        self.module_name, self.key, self.name, self.group = module_name, key, name, mesh.get_group()
        self.host, self.partial = host, partial
        self.me, self.size = mesh.get_local_rank(), mesh.size()
        self.depth, self.sizes, self.summed = 0, None, False

    def install(self, *modules: nn.Module) -> None:
        for module in modules:
            module.register_forward_pre_hook(self.before, with_kwargs=True)
            module.register_forward_hook(self.after, with_kwargs=True, always_call=True)

    def refuse(self, what: str) -> OmniArgumentError:
        return OmniArgumentError(self.module_name, self.key, what)

    def before(self, module, args, kwargs):
        self.depth += 1
        if self.depth > 1:
            return None
        if kwargs.get("use_cache") is None and takes_use_cache(module):  # unset (a released forward's call of its
            kwargs = {**kwargs, "use_cache": False}  # LLM): no cache (one of the group's rows would be no rank's)
        self.sizes = None  # a refusal below: `after` (always called, also then) keeps nothing and undoes `depth`
        self.summed = kwargs.get("num_items_in_batch") is not None  # a loss over a global count: a sum over rows
        return self._gather_inputs(module, args, kwargs)

    def _gather_inputs(self, module, args, kwargs):
        named = [(f"argument {i}", v) for i, v in enumerate(args)] + list(kwargs.items())
        first = next((v for k, v in named if k in ROWS and isinstance(v, torch.Tensor)), None)
        first = first if first is not None else next((v for _, v in named if isinstance(v, torch.Tensor) and v.ndim),
                                                     None)
        rows = first.shape[0] if first is not None else NO_ROWS
        keys = [k for k, v in named if isinstance(v, torch.Tensor) and v.ndim and v.shape[0] == rows]
        mine = [rows] + [d for k in keys for d in (dict(named)[k].ndim, *dict(named)[k].shape[1:])]
        mine = mine if len(mine) <= SHAPES else [TOO_MANY]
        meta = mine + [-1] * (SHAPES - len(mine))
        every = [rows[0] for rows in all_gather_host([meta], self.host)]  # every rank, whatever it found: a refusal
        failed = [(rank, other[0]) for rank, other in enumerate(every) if other[0] < 0]  # is everyone's
        if failed:
            rank, code = failed[0]
            raise self.refuse(f"rank {rank} of its {self.name} group " + (
                "called it with no row tensor (its forward takes its rows as tensors)" if code == NO_ROWS else
                f"called it with more row inputs than the boundary describes ({SHAPES} ints)"))
        if any(other[1:] != meta[1:] for other in every):
            raise self.refuse(f"the ranks of one {self.name} group call it with row inputs {keys} whose other "
                              "dims (or number) differ (pad them to one length across the group)")
        self.sizes = [other[0] for other in every]
        gathered = {k: GatherRows.apply(dict(named)[k], self.group, self.sizes, self.me, self.partial) for k in keys}
        args = tuple(gathered.get(f"argument {i}", v) for i, v in enumerate(args))
        return args, {k: gathered.get(k, v) for k, v in kwargs.items()}

    def after(self, module, args, kwargs, output):
        try:
            return self._keep(output, "output") if self.depth == 1 and self.sizes is not None else None
        finally:
            self.depth -= 1

    def _keep(self, value, key: str):
        if value is None or isinstance(value, (bool, int, float, str)):
            return value
        if isinstance(value, torch.Tensor):
            if value.ndim and value.shape[0] == sum(self.sizes):
                return KeepRows.apply(value, self.group, self.sizes, self.me, self.partial)
            if value.ndim == 0 and not self.partial:  # a loss over the group's rows: each rank's share (docstring)
                return value / len(self.sizes) if self.summed else value
            raise self.refuse(f"its {key} {tuple(value.shape)} is " + ("not one row per input row" if self.partial
                              else "neither one row per input row nor a scalar") + ": compute it outside the module "
                              "from its own rows")
        if isinstance(value, dict):  # ModelOutput too: its fields are its items
            for name in list(value.keys()):
                value[name] = self._keep(value[name], name)
            return value
        if isinstance(value, (tuple, list)):
            return type(value)(self._keep(v, f"{key}[{i}]") for i, v in enumerate(value))
        raise self.refuse(f"its {key} is a {type(value).__name__}, which the {self.name} boundary cannot split "
                          "by rows (a cache: pass use_cache=False)")


    def serve_generate(self, root: nn.Module) -> None:
        """`root.generate` on the group's rows: its row inputs gathered once, generation run by the whole group in
        lockstep (the cache holds the group's rows; the module's own forward calls inside it do not gather again),
        sampling from one seed drawn on the group's first rank, and each rank given its own rows of the output.
        The returned cache (`return_dict_in_generate`) is dropped: it holds the group's rows, split by heads."""
        generate = getattr(root, "generate", None)
        if not callable(generate):
            return

        @functools.wraps(generate)
        def generate_on_group_rows(*args, **kwargs):
            if self.depth:  # inside the module's own forward: its rows are the group's already
                return generate(*args, **kwargs)
            self.depth += 1
            self.sizes = None
            try:
                args, kwargs = self._gather_inputs(root, args, kwargs)
                with same_sampling(self.group, next(root.parameters()).device):
                    output = generate(*args, **kwargs)
                if isinstance(output, dict) and "past_key_values" in output:
                    output["past_key_values"] = None
                return self._keep(output, "output")
            finally:
                self.depth -= 1

        root.generate = generate_on_group_rows


def draw_seed() -> int:
    """The seed a group's first rank draws for its sampling (from its own random state)."""
    return int(torch.randint(0, 2**62, (1,), dtype=torch.int64))


@contextlib.contextmanager
def same_sampling(group, device: torch.device):
    """Every rank of `group` samples alike: the group's first rank's `draw_seed()`, broadcast (one collective per
    `generate`), seeds a fork of the random state, which is restored after."""
    seed = torch.tensor([draw_seed()], dtype=torch.int64, device=device)
    dist.broadcast(seed, src=dist.get_global_rank(group, 0), group=group)
    index = device.index if device.index is not None else 0 if device.type == "cpu" else \
        torch.accelerator.current_device_index()
    with torch.random.fork_rng(devices=[] if device.type == "cpu" else [index], device_type=device.type):
        torch.manual_seed(int(seed))
        yield


@functools.cache
def _signature_has_use_cache(forward) -> bool:
    try:
        return "use_cache" in inspect.signature(forward).parameters
    except (TypeError, ValueError):
        return False


def takes_use_cache(module: nn.Module) -> bool:
    return _signature_has_use_cache(type(module).forward)


def refuse_methods(module_name: str, root: nn.Module, methods: tuple[str, ...], key: str, name: str,
                   served: str = "`forward`, `generate` and its input embeddings") -> None:
    """Methods other than those `served` that a composed forward may call (`get_image_features`, ...) have no
    boundary yet: each present one raises, naming the module and key, when called."""
    for method in methods:
        if callable(getattr(root, method, None)):
            def refused(*args, _method=method, **kwargs):
                raise OmniArgumentError(module_name, key, f"`{_method}` of a {name} module is not supported "
                                        f"yet (only {served} have its boundary)")
            setattr(root, method, refused)
