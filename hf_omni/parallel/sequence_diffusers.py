"""Sequence parallelism on a diffusers model (`sequence.py`), through diffusers' own context parallelism (Ulysses,
`ContextParallelConfig(ulysses_degree=N)`, enabled behind `compat.enable_context_parallel`).

The module's group runs the group's rows together: each rank's row inputs (the noisy latents, the timestep, the text
states) are gathered over the group at the module's input (`boundary.Boundary`), the class's `_cp_plan` hooks split
the sequence after the patch embedding (each rank 1 / N of the tokens), diffusers' attention trades positions for
heads around each attention, and the output is gathered whole at the plan's output (`proj_out`); each rank keeps its
own rows of it. Backward: each rank's part of the module sees only its 1 / N of the tokens, so its gradients are its
part of the group's, which sum over the group to the whole (`Boundary(partial=True)`: the output gradients of every
rank's rows gathered unscaled, the input gradients summed back to their rows' ranks); FSDP2's average over the data
and sequence ranks then equals one process's over every rank's rows.

Per rank per step, for a group of N ranks running B rows of L tokens: the row inputs of the group (N x its own; the
latents and text states, not the activations), the all-to-alls of diffusers' attention ((N - 1) / N of q, k, v and
the output of 1 / N of the tokens), and the output gathered whole (B x L x the output channels).

Refused by name: attention heads N does not divide, an attention backend diffusers serves no context parallelism on
(at `OmniTrainer(...)`), and a token count N does not divide (when the module is called: diffusers splits evenly,
and padding would be attended, its attention taking no mask there).
"""

from __future__ import annotations

import torch
from torch import nn

from ..compat import (
    attention_backend_without_context_parallel, context_parallel_plan, enable_context_parallel, plan_modules,
)
from ..core.dist import host_group
from ..core.errors import OmniArgumentError
from .boundary import Boundary
from .sequence_boundary import as_keywords


def reached(module: nn.Module) -> bool:
    """A diffusers model whose class declares where its sequence is split (`_cp_plan`)."""
    return context_parallel_plan(module) is not None


def check(module_name: str, module: nn.Module, n: int, key: str) -> None:
    heads = getattr(getattr(module, "config", None), "num_attention_heads", None)
    if isinstance(heads, int) and heads % n:
        raise OmniArgumentError(module_name, key, f"{type(module).__name__} has {heads} attention heads "
                                f"(num_attention_heads), which {n} ranks cannot split evenly (Ulysses splits heads): "
                                "use an sp_size that divides it")
    backend = attention_backend_without_context_parallel(module)
    if backend is not None:
        raise OmniArgumentError(module_name, key, f"{type(module).__name__} attends through diffusers' `{backend}` "
                                "backend, on which diffusers serves no context parallelism: set another with "
                                "`set_attention_backend` (`native` runs everywhere)")


def apply(module_name: str, module: nn.Module, mesh, n: int, key: str) -> None:
    def check_output(path: str, index: int, split, x) -> None:
        if isinstance(x, torch.Tensor) and x.dim() == split.expected_dims and x.shape[split.split_dim] % n:
            _refuse_length(module_name, key, n, f"{path}'s output {index}", x, split.split_dim)

    enable_context_parallel(module, mesh, ulysses=n, check_output=check_output)


def install(module_name: str, module: nn.Module, mesh, dim: str, key: str, group_name: str) -> None:
    """The row boundary at the module's inputs and outputs (over `mesh[dim]`), and a check of each input the plan
    splits (its outputs are checked from `apply`, inside diffusers' hooks)."""
    Boundary(module_name, mesh[dim], key, group_name, host_group(mesh, dim), partial=True).install(module)
    n = mesh[dim].size()
    for path, entry in context_parallel_plan(module).items():
        inputs = {k: v for k, v in entry.items() if not v.split_output} if isinstance(entry, dict) else {}
        for part in plan_modules(module, path) if inputs else []:
            part.register_forward_pre_hook(_check_inputs(module_name, key, n, path, inputs), with_kwargs=True)


def _refuse_length(module_name: str, key: str, n: int, where: str, x: torch.Tensor, dim: int):
    raise OmniArgumentError(module_name, key, f"its sequence at {where} has {x.shape[dim]} tokens, which {n} ranks "
                            "cannot split evenly (diffusers' context parallelism splits evenly, and padded tokens "
                            "would be attended): choose frames / height / width whose token count it divides")


def _check_inputs(module_name: str, key: str, n: int, path: str, inputs: dict):
    def hook(part, args, kwargs):
        given = as_keywords(part, args, kwargs)
        for name, split in inputs.items():
            x = given.get(name)
            if isinstance(x, torch.Tensor) and x.dim() == split.expected_dims and x.shape[split.split_dim] % n:
                _refuse_length(module_name, key, n, f"{path or 'the model'}'s `{name}`", x, split.split_dim)
    return hook
