"""`parallelism: {tp_size: T}` on a `parallel: fsdp` module: tensor parallelism by the module class's own
transformers plan (`config.base_model_tp_plan` and the class's `_tp_plan`), on the `tp` dim of the module's mesh,
then FSDP2 over its data-parallel dims (`fsdp.py`).

- The plan is transformers' (`compat.tensor_parallel_plan`), applied with its own styles (`compat.apply_tensor_plan`):
  parameters become DTensors on `tp`, layers exchange plain tensors.
- Tied weights (an `lm_head` tied to the embeddings): transformers' `apply_tensor_parallelism` looks a tied name up
  as a module, so the second holder is untied before and tied again after; both must be split alike (else refused).
- The module's boundary with the data-parallel rest of the model: `boundary.py` (its forward, its input embeddings
  and `generate`); the other methods a composed forward may call are refused by name when called.
- LoRA: PEFT's wrapped layers take the plan entry's style on their base layer and one adapter (`tensor_lora.py`).
- An adopted model's module (LLaVA's `["model.language_model", "lm_head"]`): the released model's plan, its entries
  under the module's paths, applied to the released model; each path has the boundary (the released forward calls
  the embeddings, the language model and the head one after another, each on its own rows).
"""

from __future__ import annotations

from torch import nn

from ..compat import apply_tensor_plan, tensor_parallel_plan
from ..core.dist import host_group
from ..core.errors import OmniArgumentError
from ..modules.embeddings import embeddings_of
from ..modules.units import run_roots
from .boundary import Boundary, refuse_methods
from .layout import Layout, register_layout
from .tensor_lora import LORA_TERMS, adapted_plan, lora_problem, same_adapters

STYLES = {"colwise", "rowwise", "colwise_gather_output", "embedding_rowwise"}  # transformers' styles, as tested


KEY = "parallelism.tp_size"
GROUP = "tensor-parallel"


@register_layout
class TensorLayout(Layout):
    name = "tp"
    description = "tensor parallelism"
    dim = "model"
    lora_terms = LORA_TERMS
    notes = {"diffusers denoiser": "refused: a diffusers model declares no transformers tensor-parallel plan"}
    boundary = ("rows: the group's rows gathered at the module's inputs, each rank's own rows kept of its outputs "
                "(backward: the reverse)")

    @classmethod
    def lora_problem(cls, lora: dict) -> tuple[str, str] | None:
        return lora_problem(lora)

    def split(self, module: nn.Module) -> tuple[nn.Module, dict]:
        """(the model the plan is applied to, its plan): the module itself, or for an adopted model's module the
        released model with the entries under the module's paths (its LLM's layers, its `lm_head`); layers PEFT
        wrapped: the entries moved onto their base layers and split adapters (`tensor_lora`)."""
        model, plan = self.scoped(module, lambda model: tensor_parallel_plan(
            model, self.size(), self.size("dp_shard_size"), self.size("dp_replicate_size"), self.size("ep_size")))
        return model, adapted_plan(model, plan, self.module_name, KEY)

    def plan(self, module: nn.Module) -> dict:
        return self.split(module)[1]

    def check(self, module: nn.Module) -> None:
        model, plan = self.split(module)
        config = getattr(model, "config", None)
        if self.size("ep_size") == 1 and any(getattr(c, "base_model_ep_plan", None) for c in (
                config, getattr(config, "get_text_config", lambda: None)())):
            raise OmniArgumentError(self.module_name, KEY, f"{type(model).__name__} is a MoE model (its config has an "
                                    "expert-parallel plan): tensor parallelism does not split its experts; add "
                                    "ep_size (a multiple of tp_size) to spread them")
        other = next(((name, style) for name, style in plan.items() if style not in STYLES), None)
        if other is not None:  # packed (fused gate_up), experts, replicated-with-all-reduce: untested here
            raise OmniArgumentError(self.module_name, KEY, f"its plan splits {other[0]} as `{other[1]}`, which "
                                    f"hf_omni does not support yet (supported: {', '.join(sorted(STYLES))}); for MoE "
                                    "experts use ep_size")
        if not plan:
            raise OmniArgumentError(self.module_name, KEY, f"{type(module).__name__} has no tensor-parallel plan "
                                    "(transformers' `config.base_model_tp_plan` / the class's `_tp_plan`): use "
                                    "dp_shard_size / dp_replicate_size only")
        self.check_heads(model)

    def check_heads(self, model: nn.Module) -> None:
        """Attention splits by heads: the query and key/value heads of the config its plan reads divide by T."""
        config = getattr(model, "config", None)
        text = getattr(config, "get_text_config", lambda: config)()
        tp = self.size()
        for key in ("num_attention_heads", "num_key_value_heads"):
            heads = getattr(text, key, None)
            if isinstance(heads, int) and heads % tp:
                raise OmniArgumentError(self.module_name, KEY, f"{type(model).__name__} has {heads} "
                                        f"{'key/value' if 'key' in key else 'attention'} heads ({key}), which {tp} "
                                        "ranks cannot split evenly: use a tp_size that divides it")

    def apply(self, module: nn.Module, mesh) -> None:
        model, plan = self.split(module)
        same_adapters(model)  # one process's LoRA init on every rank, before each keeps its slice
        ties = untie(model, plan)
        apply_tensor_plan(model, mesh[self.name], plan)
        for holder, attr, first, name in ties:
            owner, _, first_attr = first.rpartition(".")
            tied = getattr(model.get_submodule(owner), first_attr)
            mine = getattr(holder, attr)
            if getattr(tied, "placements", None) != getattr(mine, "placements", None):
                raise OmniArgumentError(self.module_name, KEY, f"{first} and {name} are one tied weight, but its "
                                        "tensor-parallel plan splits them differently: untie them")
            setattr(holder, attr, tied)

    def after_fsdp(self, module: nn.Module, mesh, methods: tuple[str, ...]) -> None:
        embed = embeddings_of(module)
        roots = run_roots(module)  # an adopted model's module: each of its paths (its LLM, its `lm_head`)
        boundary = Boundary(self.module_name, mesh[self.name], KEY, GROUP, host_group(mesh, self.name))
        boundary.install(*roots, *([embed] if embed is not None else []))
        for root in roots:
            boundary.serve_generate(root)
            refuse_methods(self.module_name, root, tuple(m for m in methods if m != "generate"), KEY, GROUP)


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
