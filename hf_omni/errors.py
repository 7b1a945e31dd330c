"""The package's argument error: a `ValueError` whose message starts with the module and key it is about."""


class OmniArgumentError(ValueError):
    """A bad argument: the message names the module (or the top level) and the key."""

    def __init__(self, module: str | None, key: str, message: str):
        self.module, self.key = module, key
        where = f"modules.{module}.{key}" if module else key
        super().__init__(f"{where}: {message}")
