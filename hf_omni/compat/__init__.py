"""Every private API of torch / transformers / accelerate / peft that hf_omni touches, each behind a named function
(Trainer's methods and attributes that OmniTrainer relies on are checked in `trainer.hooks` instead).

The functions live in `torch_api.py` (torch), `hf_api.py` (transformers, accelerate, peft, datasets), `tp_api.py`
(transformers' tensor parallelism) and `diffusers_api.py` (diffusers' context parallelism); `symbols.py` holds the
index and `resolve`. These internals change between minor releases. `PRIVATE_SYMBOLS` lists each one (library,
dotted path); `tests/test_compat.py` checks every entry against the installed versions and fails naming the library
and symbol, and each function fails loudly (never silently) when its internal is gone.
"""

from .diffusers_api import *  # noqa: F401,F403 - the named functions, one import path for every caller
from .hf_api import *  # noqa: F401,F403
from .symbols import PRIVATE_SYMBOLS, MissingInternalError, missing_symbols, resolve  # noqa: F401
from .torch_api import *  # noqa: F401,F403
from .tp_api import *  # noqa: F401,F403
