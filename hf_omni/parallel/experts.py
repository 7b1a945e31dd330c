"""`parallelism: {dp_shard_size: S, ep_size: E}` on a `parallel: fsdp` MoE module: its fused experts spread over E
ranks by the class's own transformers plan (`config.base_model_ep_plan`), tokens routed to them all-to-all
(transformers' `AllToAllEP`), the dense rest FSDP2 over the module's mesh as without experts.

- Sizing is transformers' `DistributedConfig` rule: E divides S (x dp_replicate R: replicas hold the same experts)
  and does not multiply the world size. The experts live on a mesh of their own over the same ranks,
  `(dp_replicate, efsdp, ep)` with efsdp = S / E: each expert is whole on one rank of every E, and FSDP2 shards it
  over the efsdp ranks holding the same experts (its own unit, sharded before the module's other units).
- Every rank keeps its own batch: no boundary with the rest of the composed model. A rank sends each (token, expert)
  pair to the expert's rank and gets its result back (two all-to-alls per MoE layer and direction), so the routing
  is that of one process. The split sizes are read to the host every layer.
- Gradients: an expert's local gradient already sums the tokens of its E ranks; FSDP2's reduction over efsdp (a sum)
  and over the replicas then covers every rank's batch, divided by R x S (the data-parallel size, as the dense
  parameters' average): the mean over every rank's loss, as a data-parallel module.
- FSDP2 shards each rank's experts over efsdp on dim 0 unless that pads them by more than 5% (fewer local experts
  than efsdp ranks), then on a dim that divides (`placement.shard_dim` of the local shape).
- With `tp_size` T in the same module (attention split by its plan, experts spread; transformers' rule: E a multiple
  of T dividing S x T): the expert mesh is `(dp_replicate?, efsdp, ep)` with efsdp = S x T / E, and the ranks of a
  TP group, which run the group's rows together, each send a disjoint slice of them to the experts and gather the
  results back over `tp` (transformers' `AllToAllEP` given the `tp` mesh as the ranks sharing a batch): every token
  reaches its experts once. The gradient conventions above hold with the TP boundary's (each TP group's rows
  weighted 1/T), so the divide factor stays R x S.
- LoRA on the dense layers (attention, router, shared experts) composes as under FSDP2 alone; adapters on the fused
  experts (PEFT's `target_parameters`) are refused by name.
"""

from __future__ import annotations

from torch import nn

from ..compat import apply_expert_plan, expert_parallel_plan
from ..core.errors import OmniArgumentError
from .layout import Layout, register_layout
from .placement import shard_dim

KEY = "parallelism.ep_size"
FUSED = "grouped_gemm"  # the plan's style of a fused expert weight (experts on its dim 0)
DISPATCH = "ep_dispatch_experts"  # the plan's style of an experts module (tokens routed to it)


@register_layout
class ExpertLayout(Layout):
    name = "ep"
    description = "expert parallelism"
    dim = None  # experts on a mesh of their own over the same ranks: `mesh()`
    divides = ("dp_shard_size", "tp_size")
    divides_why = ("set dp_shard_size: with ep_size the entry names every size) (transformers' DistributedConfig "
                   "rule: experts are spread inside the shard group, never over more ranks")
    multiple_of = ("tp_size",)
    multiple_of_why = "transformers' DistributedConfig rule: an expert group is whole tensor-parallel groups"
    notes = {"loss from labels": "n/a: no boundary (every rank runs its own rows), a loss inside the module is as "
                                 "under FSDP2",
             "tied embeddings": "n/a: it splits only the experts; the embeddings are FSDP2's",
             "diffusers denoiser": "refused: a diffusers model declares no transformers expert-parallel plan"}
    lora_terms = ("on its dense layers (attention, router, shared experts); on the fused experts (PEFT's "
                  "`target_parameters`) refused")

    def split(self, module: nn.Module) -> tuple[nn.Module, dict]:
        """(the model the plan is applied to, its plan): the module itself, or an adopted model's module's released
        model with the entries under its paths (`Layout.scoped`)."""
        return self.scoped(module, self.model_plan)

    def model_plan(self, model: nn.Module) -> dict:
        try:
            return expert_parallel_plan(model, self.size(), self.size("dp_shard_size"),
                                        self.size("dp_replicate_size"), self.size("tp_size"))
        except ValueError as err:  # transformers' own sizing rule; "... has no `ep_plan`": refused by `check`
            if "ep_plan" in str(err):
                return {}
            raise OmniArgumentError(self.module_name, KEY, str(err)) from None

    def check(self, module: nn.Module) -> None:
        model, plan = self.split(module)
        ep = self.size()
        if not any(style == DISPATCH for style in plan.values()):
            raise OmniArgumentError(self.module_name, KEY, f"{type(model).__name__} has no expert-parallel plan "
                                    "(transformers' `config.base_model_ep_plan`): use dp_shard_size / "
                                    "dp_replicate_size only")
        self.check_adapters(model, plan)
        params = dict(model.named_parameters())
        for name, style in plan.items():
            if style == FUSED and name in params and params[name].shape[0] % ep:
                raise OmniArgumentError(self.module_name, KEY, f"{name} holds {params[name].shape[0]} experts, "
                                        f"which {ep} ranks cannot hold evenly: use an ep_size that divides it")

    def check_adapters(self, model: nn.Module, plan: dict) -> None:
        """LoRA composes with the dense layers; PEFT's adapters on the fused experts (`target_parameters` wraps the
        experts module in a `ParamWrapper`, its adapters one block per expert) would need splitting by expert
        ranges like the experts: refused, naming the module."""
        modules = dict(model.named_modules())
        for name, style in plan.items():
            owner = modules.get(name) or modules.get(name.rpartition(".")[0])
            if owner is not None and type(owner).__module__.startswith("peft."):
                raise OmniArgumentError(self.module_name, "lora", f"{name} is split `{style}` by expert parallelism "
                                        f"and wrapped by PEFT ({type(owner).__name__}): adapters on fused experts "
                                        "under ep_size are not supported (they would need splitting by expert ranges "
                                        "like the experts); leave the experts out of lora.target_parameters / "
                                        "target_modules")

    def mesh(self):
        """`(dp_replicate?, efsdp, ep, batch)` over every rank; efsdp = S x T / E; `batch`: the ranks holding one
        batch without tensor parallelism (this one)."""
        replicate, ep = self.size("dp_replicate_size"), self.size()
        shape = (self.size("dp_shard_size") * self.size("tp_size") // ep, ep, 1)
        names = ("efsdp", "ep", "batch")
        if replicate > 1:
            shape, names = (replicate, *shape), ("dp_replicate", *names)
        return self.meshes.get(shape, names)

    def apply(self, module: nn.Module, mesh) -> None:
        (model, plan), experts = self.split(module), self.mesh()
        batch = mesh["tp"] if self.size("tp_size") > 1 else experts["batch"]  # the ranks sharing one batch
        apply_expert_plan(model, experts["ep"], batch, plan)
        self.units = [model.get_submodule(name) for name, style in plan.items() if style == DISPATCH]

    def shard_first(self, module: nn.Module, kwargs: dict) -> None:
        """Each experts module its own FSDP2 unit over the ranks holding the same experts (and the replicas)."""
        from torch.distributed.fsdp import fully_shard

        experts, replicate = self.mesh(), self.size("dp_replicate_size")
        data = experts["dp_replicate", "efsdp"] if replicate > 1 else experts["efsdp"]
        place = local_placement_fn(experts["efsdp"].size())
        for unit in self.units:
            fully_shard(unit, **{**kwargs, "mesh": data, "shard_placement_fn": place})
            unit.set_gradient_divide_factor(float(replicate * self.size("dp_shard_size")))
            if experts["efsdp"].size() > 1:  # a factor other than the group size is PREMUL_SUM (gloo has none, NCCL
                unit.set_force_sum_reduction_for_comms(True)  # bf16 zeroes): sum, then divide. Over one efsdp rank
                # FSDP2 divides its copy by the factor and all-reduces the replicas with SUM: forced, it would divide
                # twice


def local_placement_fn(ranks: int):
    """FSDP2's dim for each expert weight over `ranks` efsdp ranks: `placement.shard_dim` of this rank's experts
    (its local shape: experts / E rows), so experts that do not divide over efsdp (Mixtral's 8 over ep 8 and efsdp 64:
    one expert a rank) are sharded on a dim that divides instead of padded to one whole expert per rank."""
    from torch.distributed.tensor import Shard

    def place(param):
        local = param.to_local() if hasattr(param, "to_local") else param
        dim = shard_dim(tuple(local.shape), ranks)
        return Shard(dim) if dim else None

    return place
