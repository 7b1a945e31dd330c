"""The package's own `ValueError`s: a bad argument (the message starts with the module and key it is about), and a
damaged file (the message names the file and what to do)."""


class OmniArgumentError(ValueError):
    """A bad argument: the message names the module (or the top level) and the key."""

    def __init__(self, module: str | None, key: str, message: str):
        self.module, self.key = module, key
        where = f"modules.{module}.{key}" if module else key
        super().__init__(f"{where}: {message}")


class DamagedFileError(ValueError):
    """A file a resume or an export reads is missing, cut short or unreadable: `path` is that file, and the message
    names it and what to do, so that a user never has to guess which of a checkpoint's files failed."""

    def __init__(self, path: str, message: str):
        self.path = path
        super().__init__(message)
