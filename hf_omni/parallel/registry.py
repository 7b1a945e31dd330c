"""`register_strategy`: the public way to add a `parallel:` value, a `Strategy` subclass under a name (the built-in
strategies register themselves with `strategy.register`). `parallel:` values are checked against the registry when
arguments are validated, so a name registered after `import hf_omni` is accepted."""

from __future__ import annotations

from .strategy import STRATEGIES, Strategy


def register_strategy(name: str, cls: type[Strategy]) -> type[Strategy]:
    """Register `cls` (a `Strategy` subclass) as `parallel: <name>`; returns `cls` (its `name` becomes `name`).
    Registering the same class again under its name does nothing; a name another class holds is refused, as is a
    class that names itself otherwise."""
    if not isinstance(name, str) or not name.isidentifier():
        raise ValueError(f"register_strategy: a strategy's name is an identifier (a `parallel:` value), got {name!r}")
    if not (isinstance(cls, type) and issubclass(cls, Strategy)) or cls is Strategy:
        raise TypeError(f"register_strategy({name!r}, ...) takes a subclass of hf_omni.parallel.strategy.Strategy, "
                        f"got {cls!r}")
    taken = STRATEGIES.get(name)
    if taken is not None and taken is not cls:
        raise ValueError(f"register_strategy: `parallel: {name}` is {taken.__module__}.{taken.__qualname__} already; "
                         f"choose another name for {cls.__qualname__}")
    own = cls.__dict__.get("name")
    if own not in (None, "", name):
        raise ValueError(f"register_strategy: {cls.__qualname__}.name is {own!r}, not {name!r}")
    cls.name = name
    STRATEGIES[name] = cls
    return cls
