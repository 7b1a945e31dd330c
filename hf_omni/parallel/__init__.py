"""How modules run across ranks: one `Strategy` per module (`strategy`; a file each: `none`, `ddp`, `fsdp`),
registered by name and applied by the ordered `driver`, on per-module device meshes (`mesh`); `fsdp` composes the
`layouts` a module's sizes ask for (`tensor`: tensor parallelism, `experts`: expert parallelism). Importing the
package registers them all."""

from . import ddp, experts, fsdp, none, tensor  # noqa: F401 (each registers its strategy or layout)
from .strategy import register_strategy, strategy_names  # noqa: F401
