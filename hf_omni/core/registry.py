"""`Registry`: the kinds hf_omni is extended with — strategies (`parallel:`), layouts (`parallelism:` sizes), module
formats and compositions — each entry a class with a `name`, a one-line `description` and a `settings_class` (None:
it takes no settings), added with its kind's `register_*` function, all of one shape::

    register_strategy(MyStrategy)          # its `name`; or register_strategy("name", MyStrategy); or @register_strategy

An entry is found by name (`registry["name"]`), or asked in order (`iter(registry)`, `registry[0]`): the entries
registered from outside hf_omni first, the latest first, then hf_omni's own in the order it registers them. A kind
whose entries are stateless keeps one instance of each (`instances=True`: module formats, compositions).
"""

from __future__ import annotations


class Registry:
    """The entries of one kind, by name."""

    def __init__(self, kind: str, base: type, *, instances: bool = False, identifiers: bool = False,
                 label: str = "{name}"):
        self.kind, self.base, self.instances, self.identifiers = kind, base, instances, identifiers
        self.label = label  # how a name reads where the user writes it (`parallel: {name}`), for messages
        self._classes: dict[str, type] = {}
        self._made: dict[str, object] = {}
        self._added: list[str] = []  # registered from outside hf_omni, oldest first

    # -- registering ------------------------------------------------------------------------------
    def register(self, name_or_cls: str | type | None = None, cls: type | None = None):
        """`register(cls)` (its own `name`), `register(name, cls)`, or a decorator (`@register`,
        `@register("name")`). Returns `cls`. The same class again is a no-op (one registered from outside moves to
        the front); a name another class holds, or a class that names itself otherwise, is refused."""
        if isinstance(name_or_cls, type) and cls is None:
            return self._add(None, name_or_cls)
        if cls is None:
            return lambda later: self._add(name_or_cls, later)
        return self._add(name_or_cls, cls)

    def _add(self, name: str | None, cls) -> type:
        verb = f"register_{self.kind}"
        if not (isinstance(cls, type) and issubclass(cls, self.base)) or cls is self.base:
            raise TypeError(f"{verb} takes a {self.base.__name__} subclass (a subclass of {self.base.__module__}."
                            f"{self.base.__qualname__}), got {cls!r}")
        own = cls.__dict__.get("name")
        name = name if name is not None else (own or cls.__qualname__)
        if not isinstance(name, str) or not name or (self.identifiers and not name.isidentifier()):
            raise ValueError(f"{verb}: a {self.kind}'s name is " + ("an identifier" if self.identifiers else
                             "a non-empty string") + f" ({self.label.format(name='<name>')}), got {name!r}")
        taken = self._classes.get(name)
        if taken is not None and taken is not cls:
            raise ValueError(f"{verb}: {self.label.format(name=name)} is {taken.__module__}.{taken.__qualname__} "
                             f"already; choose another name for {cls.__qualname__}")
        if own not in (None, "", name):
            raise ValueError(f"{verb}: {cls.__qualname__}.name is {own!r}, not {name!r}")
        cls.name = name
        self._classes[name] = cls
        if not cls.__module__.startswith("hf_omni."):
            self._added = [n for n in self._added if n != name] + [name]
        return cls

    def __delitem__(self, name: str) -> None:
        del self._classes[name]
        self._made.pop(name, None)
        self._added = [n for n in self._added if n != name]

    # -- asking -----------------------------------------------------------------------------------
    def names(self) -> tuple[str, ...]:
        """Every name, in the order entries are asked."""
        shipped = [n for n in self._classes if n not in self._added]
        return tuple([*reversed(self._added), *shipped])

    def entry(self, name: str):
        """The class registered under `name`, or its one instance (`instances=True`)."""
        cls = self._classes[name]
        if not self.instances:
            return cls
        if type(self._made.get(name)) is not cls:
            self._made[name] = cls()
        return self._made[name]

    def __getitem__(self, key: str | int):
        return self.entry(self.names()[key] if isinstance(key, int) else key)

    def get(self, name: str, default=None):
        return self.entry(name) if name in self._classes else default

    def __contains__(self, name: str) -> bool:
        return name in self._classes

    def __iter__(self):
        return iter([self.entry(name) for name in self.names()])

    def __len__(self) -> int:
        return len(self._classes)

    def values(self) -> list:
        return list(self)

    def own(self) -> list:
        """The entries hf_omni registers itself (what its docs list), in the order it registers them."""
        return [self.entry(n) for n in self.names() if n not in self._added]

    def table(self) -> list[str]:
        """A markdown table of hf_omni's own entries (name, what it is, its settings), for the docs."""
        rows = [f"| {self.kind.replace('_', ' ')} | what it is | settings |", "|---|---|---|"]
        for name in (n for n in self.names() if n not in self._added):
            cls = self._classes[name]
            settings = getattr(cls, "settings_class", None)
            rows.append(f"| `{name}` | {getattr(cls, 'description', '') or ''} | "
                        f"{f'`{settings.__name__}`' if settings is not None else '-'} |")
        return rows
