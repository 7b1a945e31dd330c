"""`OmniConfig`: the root `config.json` of a composed model, and the one rule for where a module's weights are.

It records the module names in order, and for each its class, its subfolder and, for a module whose weights
come from elsewhere (a released encoder loaded from a local folder, a frozen module written once to
`frozen/<module>/`), its source path. A module loaded from the Hub records that repo and the commit it was loaded
at (`hub_repo`, `hub_revision`): a composition pushed to the Hub links such a module (still frozen) instead of
uploading it again, and `trained` (set once a training run prepared the model) says whether it was changed.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field, fields

from transformers import PretrainedConfig


@dataclass
class ModuleEntry:
    """What the root config records of one module (`"class"` on disk: `cls` here). Checked when made: `subfolder`
    a plain folder name, `source` absolute, `hub_repo` a repo id, `hub_revision` a branch, tag or commit."""

    name: str
    cls: str
    subfolder: str
    source: str | None = None
    processor: str | None = None  # the kind of its processor (`folder.PROCESSOR_KINDS`), saved beside it
    hub_repo: str | None = None  # the Hub repo it was loaded from, and the commit
    hub_revision: str | None = None
    trained: bool | None = None  # set once a training run prepared it; None: unknown
    extra: dict = field(default_factory=dict)  # keys of a newer hf_omni, kept as they are

    def __post_init__(self):
        self.check()

    def __setattr__(self, key, value):  # a changed entry is checked again (a source recorded later, say)
        before = self.__dict__.get(key)
        super().__setattr__(key, value)
        if key != "extra" and "extra" in self.__dict__:
            try:
                self.check()
            except UnsafePathError:
                super().__setattr__(key, before)  # refused: the entry stays as it was
                raise

    def check(self) -> None:
        name, sub, source = self.name, self.subfolder, self.source
        if self.hub_repo is not None and repo_id_error(self.hub_repo):
            raise UnsafePathError(f"module {name!r}: hub_repo {self.hub_repo!r} is not a Hub repo id "
                                  f"({repo_id_error(self.hub_repo)})")
        revision = self.hub_revision
        if revision is not None and (not isinstance(revision, str) or not REVISION.fullmatch(revision)
                                     or ".." in revision or revision.startswith("/")):
            raise UnsafePathError(f"module {name!r}: hub_revision {revision!r} is not a branch, tag or commit name")
        if not isinstance(sub, str) or sub in ("", ".", "..") or "/" in sub or "\\" in sub or os.path.isabs(sub):
            raise UnsafePathError(f"module {name!r}: subfolder {sub!r} must be a plain folder name")
        if source is not None and (not isinstance(source, str) or not os.path.isabs(source)):
            raise UnsafePathError(f"module {name!r}: source {source!r} must be an absolute path to a module folder")

    @classmethod
    def from_dict(cls, value: dict) -> "ModuleEntry":
        known = {f.name for f in fields(cls)} - {"cls", "extra"}
        value = dict(value)
        return cls(cls=value.pop("class"), **{k: value.pop(k) for k in list(value) if k in known}, extra=value)

    def to_dict(self) -> dict:
        out = {"name": self.name, "class": self.cls, "subfolder": self.subfolder, "source": self.source,
               "processor": self.processor, "hub_repo": self.hub_repo, "hub_revision": self.hub_revision,
               "trained": self.trained}
        return {**self.extra, **out}


class OmniConfig(PretrainedConfig):
    """Root configuration of an `OmniModel`: `modules`, one `ModuleEntry` per module in order (a dict each on disk),
    and `omni_class`, the composed model's class."""

    model_type = "hf_omni"

    def __init__(self, modules: list | None = None, omni_class: str | None = None, **kwargs):
        self.modules = [m if isinstance(m, ModuleEntry) else ModuleEntry.from_dict(m) for m in (modules or [])]
        self.omni_class = omni_class
        super().__init__(**kwargs)

    def to_dict(self) -> dict:
        out = super().to_dict()
        out["modules"] = [m.to_dict() for m in self.modules]
        return out

    @property
    def module_names(self) -> list[str]:
        return [m.name for m in self.modules]

    def module_entry(self, name: str) -> ModuleEntry:
        for entry in self.modules:
            if entry.name == name:
                return entry
        raise KeyError(f"no module named {name!r} in OmniConfig (modules: {self.module_names})")


def repo_id_error(repo_id) -> str | None:
    """Why `repo_id` is not a Hub repo id (`name` or `org/name`), or None when it is one."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(repo_id)
    except (HFValidationError, TypeError) as err:
        return str(err)
    return None


REVISION = re.compile(r"[A-Za-z0-9][A-Za-z0-9._/-]{0,127}")


class UnsafePathError(ValueError):
    """A module path in a root config that could lead outside the folder holding it."""
