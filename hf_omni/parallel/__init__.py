"""How modules run across ranks: one `Strategy` per module (`strategy`: the interface and its registry; a file
each: `none`, `ddp`, `fsdp` with its settings `fsdp_settings`), the layouts a module's `parallelism` sizes ask for
(`layout`: the interface and its registry; `tensor` with its row `boundary` and its LoRA placement `tensor_lora`,
`experts`, `sequence` with its boundary `sequence_boundary`, all-to-alls `sequence_exchange` and its diffusers
path `sequence_diffusers`), each module's dimensions and meshes built from their declarations (`dims`), applied by
the ordered `driver` (its shared state: `prepared`; adopted models' nesting: `nesting`). Helpers: which dim FSDP2
shards each parameter on (`placement`), tensors an adopted module holds loose (`loose`). Importing the package
registers every strategy and layout."""

from . import ddp, experts, fsdp, none, sequence, tensor  # noqa: F401 (each registers its strategy or layout)
from .strategy import register_strategy, strategy_names  # noqa: F401
