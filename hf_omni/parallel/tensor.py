"""`parallelism: {tp_size: T}` on a `parallel: fsdp` module: tensor parallelism by the module class's own
transformers plan (`config.base_model_tp_plan` and the class's `_tp_plan`), on the `tp` dim of the module's mesh,
then FSDP2 over its data-parallel dims (`fsdp.py`).

- The plan is transformers' (`compat.tensor_parallel_plan`), applied with its own styles (`compat.apply_tensor_plan`):
  parameters become DTensors on `tp`, layers exchange plain tensors.
- Tied weights (an `lm_head` tied to the embeddings): transformers' `apply_tensor_parallelism` looks a tied name up
  as a module, so the second holder is untied before and tied again after; both must be split alike (else refused).
- The module's boundary with the data-parallel rest of the model: `boundary.py` (its forward and input embeddings);
  the other methods a composed forward may call (`generate`, ...) are refused by name when called.
"""

from __future__ import annotations

from torch import nn

from ..compat import apply_tensor_plan, tensor_parallel_plan
from ..errors import OmniArgumentError
from ..modules.classes import embeddings_of
from .boundary import KEY, Boundary, refuse_methods
from .layouts import Layout, register_layout


@register_layout
class TensorLayout(Layout):
    size_key = "tp_size"
    dim = "tp"

    def plan(self, module: nn.Module) -> dict:
        sizes = self.sizes
        return tensor_parallel_plan(module, sizes["tp_size"], sizes.get("dp_shard_size", 1),
                                    sizes.get("dp_replicate_size", 1))

    def check(self, module: nn.Module) -> None:
        if not self.plan(module):
            raise OmniArgumentError(self.module_name, KEY, f"{type(module).__name__} has no tensor-parallel plan "
                                    "(transformers' `config.base_model_tp_plan` / the class's `_tp_plan`): use "
                                    "dp_shard_size / dp_replicate_size only")

    def apply(self, module: nn.Module, mesh) -> None:
        plan = self.plan(module)
        ties = untie(module, plan)
        apply_tensor_plan(module, mesh[self.dim], plan)
        for holder, attr, first, name in ties:
            owner, _, first_attr = first.rpartition(".")
            tied = getattr(module.get_submodule(owner), first_attr)
            mine = getattr(holder, attr)
            if getattr(tied, "placements", None) != getattr(mine, "placements", None):
                raise OmniArgumentError(self.module_name, KEY, f"{first} and {name} are one tied weight, but its "
                                        "tensor-parallel plan splits them differently: untie them")
            setattr(holder, attr, tied)

    def after_fsdp(self, module: nn.Module, mesh, methods: tuple[str, ...]) -> None:
        embed = embeddings_of(module)
        Boundary(self.module_name, mesh[self.dim]).install(module, *([embed] if embed is not None else []))
        refuse_methods(self.module_name, module, methods)


def untie(module: nn.Module, plan: dict) -> list[tuple[nn.Module, str, str, str]]:
    """Give each plan entry that names a tied parameter's second holder its own copy (to tie again after the split):
    `(holder, attribute, the first holder's name, this name)` each."""
    first_name = {id(p): name for name, p in module.named_parameters()}
    ties = []
    for name in plan:
        owner, _, attr = name.rpartition(".")
        try:
            holder = module.get_submodule(owner)
        except AttributeError:
            continue
        param = dict(holder.named_parameters(recurse=False, remove_duplicate=False)).get(attr)
        if param is not None and first_name.get(id(param), name) != name:
            setattr(holder, attr, nn.Parameter(param.detach().clone(), requires_grad=param.requires_grad))
            ties.append((holder, attr, first_name[id(param)], name))
    return ties
