"""`Composition`: a kind of composed model — how one is built, what its root config records, what its saves write
beside the module folders and how they load back, how it is pushed and exported — and its registry
(`COMPOSITIONS`): a plain composition (`from_modules`), an adopted released model (`from_model`), a diffusers
pipeline (`from_pipeline`), one file each under `compositions/`.

`OmniModel`, the checkpointer, the Hub push and `hf-omni export` ask the composition of a model (`composition_of`:
the first whose record its root config holds) or of a saved folder (`saved_composition`: the first that recognises
it), never its kind. A new kind is one `Composition` subclass plus `register_composition` (docs/how_it_works.md).
The defaults are the plain composition's answers where it has none to give."""

from __future__ import annotations

from ..core.registry import Registry


class Composition:
    """A kind of composed model. Subclass it and answer what differs from a plain composition."""

    name = ""  # its registry name
    description = ""  # one line, for the docs
    settings_class = None
    catch_all = False  # what a root config or a saved folder is when no other kind claims it (asked last)

    def holds(self, config) -> bool:
        """Whether a root config (`OmniConfig`) records a model of this kind."""
        return False

    def recognises(self, root: str, revision=None, token=None, cache_dir=None) -> bool:
        """Whether `root` (a folder or a repo id) is a saved model this kind loads by itself, before any root
        `config.json` is read (an adopted model's released format)."""
        return False

    def owns_saved(self, root: str) -> bool:
        """Whether the local folder `root` (an export or a checkpoint) is a save of this kind, by its files."""
        return False

    def compose(self, cls, *args, **kwargs):
        """Its constructor (`OmniModel.from_modules`, `from_model`, `from_pipeline`): a model of `cls` or its own."""
        raise NotImplementedError(f"{self.name} compositions are not built this way")

    def load(self, cls, root: str, **kwargs):
        """`cls.from_pretrained(root, **kwargs)` of a saved model of this kind."""
        raise NotImplementedError(f"{self.name} compositions are loaded as plain ones")

    def config_record(self, model) -> dict:
        """The keys it adds to the root config beside the module entries."""
        return {}

    def save(self, model, directory: str, *, is_main_process: bool, merge_lora: bool, max_shard_size,
             **kwargs) -> None:
        """`save_pretrained`: every rank calls it (a sharded module: each writes its own rows)."""
        raise NotImplementedError

    def write_root(self, model, directory: str) -> None:
        """The main process: the root `config.json` and what it writes beside the module folders (a checkpoint's
        root too)."""
        raise NotImplementedError

    def save_checkpoint(self, model, directory: str) -> None:
        """Every rank, in a checkpoint after the module folders: what a resume or an export needs beyond them."""

    def load_beside(self, model, root: str) -> None:
        """After its modules are loaded from `root`: what a save wrote beside them."""

    def beside_patterns(self, config) -> list[str]:
        """The files a Hub download fetches beside the module folders (patterns, relative to the repo's root)."""
        return []

    def check_push(self, args, model) -> None:
        """Before any compute: the Hub settings of `args` a push of `model` could not serve, refused by key."""

    def push(self, root: str, repo_id: str, **kwargs) -> dict[str, str]:
        """Push the save at `root` to `repo_id`; returns `{repo: commit}` of the commits made."""
        raise NotImplementedError

    def export_checkpoint(self, checkpoint: str, config, out: str) -> None:
        """`hf-omni export`: the complete checkpoint `checkpoint` (root config `config`) as an export in `out`."""
        raise NotImplementedError


COMPOSITIONS = Registry("composition", Composition, instances=True, identifiers=True)


def register_composition(cls: type[Composition]) -> type[Composition]:
    """Make a kind of composed model of your own known, in the same shape as every `register_*`."""
    return COMPOSITIONS.register(cls)


def asked() -> list[Composition]:
    """The compositions in the order they are asked: registered ones first, the catch-all last."""
    return sorted(COMPOSITIONS, key=lambda c: c.catch_all)


def composition_of(config) -> Composition:
    """The composition a root config (`model.config`) records: the first that holds it."""
    return next(c for c in asked() if c.holds(config))


def saved_composition(root: str, **hub) -> Composition | None:
    """The composition that loads `root` by itself (`recognises`), or None: a plain root config."""
    return next((c for c in asked() if c.recognises(root, **hub)), None)


def owner_of_saved(root: str) -> Composition:
    """The composition whose save the local folder `root` is (the plain one when no other claims it)."""
    return next(c for c in asked() if c.owns_saved(root))
