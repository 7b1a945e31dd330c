"""How modules run across ranks: one `Strategy` per module (`strategy`; a file each: `none`, `ddp`, `fsdp`),
registered by name and applied by the ordered `driver`, on per-module device meshes (`mesh`). Importing the
package registers the strategies."""

from . import ddp, fsdp, none  # noqa: F401 (each registers its strategy)
from .registry import register_strategy  # noqa: F401
from .strategy import strategy_names  # noqa: F401
