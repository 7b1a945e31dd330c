"""`parallelism: {sp_size: N}` on a `parallel: fsdp` module: Ulysses sequence parallelism. The module's group of N
ranks runs the group's rows together, each rank on 1 / N of the positions (`sequence_boundary.py`); around each
attention an all-to-all trades the sequence split for a head split (each rank attends over every position for
1 / N of the heads) and another trades it back (`sequence_exchange.Swap`). No weight is split: FSDP2 shards the
module over its data dims and `sp` together (torchtitan's `dp_shard x cp`), so checkpoints and exports are the data-
parallel ones.

- transformers modules through transformers' own attention interface: an attention function registered under a
  name of the module's own (`AttentionInterface.register`) wraps the one the module was configured with (sdpa, eager,
  flash) and is set with the model's `set_attn_implementation`; no model code is edited. Under that name
  transformers builds no mask (none is needed: sdpa and flash take `is_causal` over the whole sequence, eager is
  given the causal mask of the whole sequence; padding is on the right, left padding turned so:
  `sequence_boundary.py`).
- An adopted model's module (LLaVA's `["model.language_model", "lm_head"]`): the paths holding attention (the
  language model) take the wrapped attention and the boundary; the released forward runs the rest on whole rows
  (`lm_head`, its loss). Multimodal rotary positions (Qwen2.5-VL's (3, rows, positions)) are split as the rest.
- Key/value heads fewer than N (N a multiple of them, GQA / MQA): each repeated N / KV times before the exchange, as
  DeepSpeed's Ulysses does (k and v then send N / KV times the bytes).
- diffusers models through diffusers' own context parallelism (`sequence_diffusers.py`): the class's `_cp_plan`
  splits the sequence after the patch embedding and gathers it at the output; its attention's Ulysses exchanges.
- Refused by name: a module whose attention is reached neither way (a class that cannot set its attention
  implementation, a diffusers model without a `_cp_plan`), bidirectional attention in a transformers module
  (padding would be attended), attention heads that N does not divide, key/value heads that N neither divides nor
  is a multiple of, `tp_size` / `ep_size` in the same module, `generate` and the module's other methods when
  called.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from torch import nn

from ..compat import attention_of, set_attention
from ..core.dist import host_group
from ..core.errors import OmniArgumentError
from ..modules.units import run_roots
from . import sequence_diffusers
from .boundary import refuse_methods
from .layout import Layout, register_layout
from .sequence_boundary import SequenceBoundary
from .sequence_exchange import Swap

KEY = "parallelism.sp_size"
GROUP = "sequence-parallel"


@register_layout
class SequenceLayout(Layout):
    name = "sp"
    description = "sequence parallelism (Ulysses)"
    dim = "shard"  # FSDP2 shards over it with dp_shard: no weight is split
    excludes = ("tp_size", "ep_size")
    diffusers = False  # a diffusers model (`sequence_diffusers.py`), set by `apply`
    lora_terms = "yes (no weight is split)"
    boundary = ("positions: the group's rows exchanged to each rank's 1 / N of the positions at the module's inputs, "
                "outputs back to their rows (all-to-all both ways)")
    notes = {"tied embeddings": "n/a: it splits no weight; the embeddings are FSDP2's",
             "generate": "refused: a KV cache of the group's rows' chunks is no rank's; called, it raises by name",
             "the other layout": "refused: tp_size or ep_size with sp_size in one module is refused by name"}

    def attended(self, module: nn.Module) -> list[nn.Module]:
        """What runs of the module whose attention goes through transformers' interface: the module itself, or an
        adopted model's paths holding attention (its language model; not its `lm_head`)."""
        return [root for root in run_roots(module) if attention_of(root) is not None]

    def check(self, module: nn.Module) -> None:
        n = self.size()
        if sequence_diffusers.reached(module):
            return sequence_diffusers.check(self.module_name, module, n, KEY)
        attended = self.attended(module)
        if not attended:
            raise OmniArgumentError(self.module_name, KEY, f"{type(module).__name__}'s attention is reached neither "
                                    "through transformers' attention interface nor through diffusers' context-"
                                    "parallel plan (`_cp_plan`): sequence parallelism cannot split it")
        for root in attended:
            if any(getattr(m, "is_causal", True) is False for m in root.modules()):
                raise OmniArgumentError(self.module_name, KEY, f"{type(root).__name__} has bidirectional attention: "
                                        "the positions padded to the group's length would be attended (only causal "
                                        "attention leaves right padding unread); not supported yet")
            config = root.config
            text = getattr(config, "get_text_config", lambda: config)()
            heads, kv = getattr(text, "num_attention_heads", None), getattr(text, "num_key_value_heads", None)
            if isinstance(heads, int) and heads % n:
                raise OmniArgumentError(self.module_name, KEY, f"{type(root).__name__} has {heads} attention heads "
                                        f"(num_attention_heads), which {n} ranks cannot split evenly (Ulysses splits "
                                        "heads): use an sp_size that divides it")
            if isinstance(kv, int) and kv % n and n % kv:
                raise OmniArgumentError(self.module_name, KEY, f"{type(root).__name__} has {kv} key/value heads "
                                        f"(num_key_value_heads): {n} ranks neither split them evenly nor hold whole "
                                        "copies of them; use an sp_size that divides them or that they divide")

    def apply(self, module: nn.Module, mesh) -> None:
        self.diffusers = sequence_diffusers.reached(module)
        if self.diffusers:
            return sequence_diffusers.apply(self.module_name, module, mesh[self.name], self.size(), KEY)
        self.roots = self.attended(module)
        for i, root in enumerate(self.roots):
            wrapped = ulysses(attention_of(root), mesh[self.name].get_group())
            set_attention(root, f"hf_omni_sp_{self.module_name}" + (f"_{i}" if i else ""), wrapped)

    def after_fsdp(self, module: nn.Module, mesh, methods: tuple[str, ...]) -> None:
        if self.diffusers:
            sequence_diffusers.install(self.module_name, module, mesh, self.name, KEY, GROUP)
        else:
            SequenceBoundary(self.module_name, mesh[self.name], KEY, host_group(mesh, self.name)).install(*self.roots)
        for root in run_roots(module):
            refuse_methods(self.module_name, root, methods, KEY, GROUP, served="`forward` (a KV cache of the "
                           "group's rows' chunks would be no rank's)")


def ulysses(base: str, group):
    """The attention function: q, k, v of this rank's positions and every head -> every position and 1 / N of the
    heads (one all-to-all each), the configured attention over the whole sequence, and back."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    def attention(module, query, key, value, attention_mask, **kwargs):
        eager = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)  # the model's own
        fn = ALL_ATTENTION_FUNCTIONS.get_interface(base, eager)
        n = dist.get_world_size(group)
        if key.shape[1] % n:  # fewer key/value heads than ranks (n a multiple of them): each repeated n / KV times,
            key, value = (t.repeat_interleave(n // t.shape[1], dim=1) for t in (key, value))  # DeepSpeed's way
            module = Groups(module, query.shape[1] // n)  # one key/value head a rank: its queries share it
        q, k, v = (Swap.apply(t, group, 1, 2) for t in (query, key, value))  # (B, H / N, L, D)
        kwargs.pop("position_ids", None)  # this rank's positions: flash would read them as packed sequences
        mask = None
        if base == "eager" and getattr(module, "is_causal", True):  # eager takes no `is_causal`
            length = q.shape[2]
            mask = torch.full((length, length), torch.finfo(q.dtype).min, device=q.device, dtype=q.dtype).triu(1)
            mask = mask[None, None]
        out, _ = fn(module, q, k, v, mask, **kwargs)  # (B, L, H / N, D)
        return Swap.apply(out, group, 1, 2), None  # (B, L / N, H, D)

    return attention


class Groups:
    """An attention module seen with another `num_key_value_groups` (query heads per key/value head on this rank),
    for the attention functions that repeat key/value heads themselves."""

    def __init__(self, module: nn.Module, groups: int):
        self._module, self.num_key_value_groups = module, groups

    def __getattr__(self, name: str):
        return getattr(self._module, name)

