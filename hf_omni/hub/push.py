"""Push a saved composed model (an export, or a checkpoint's module folders) to the Hub, one commit per repo.

`hub_layout: per_module` (default): each uploaded module to its own repo (`<repo_id>-<module>`, or the module's
`hub_model_id`), loadable alone with its Auto class, then the composition repo `<repo_id>`: the root `config.json`
pointing at each module's repo and the commit just made there (or, for a linked module, the commit it was loaded
at). `single`: one repo, the root config plus a subfolder per uploaded module.

Linked, not uploaded: a module recorded as loaded from the Hub (`hub_repo`) and not trained in the run
(`trained: false`). A module whose training is unknown is uploaded (the composition must load elsewhere).
Per-module `push_to_hub: true | false` overrides; `false` links to its `hub_model_id` or its Hub origin.
Modules are pushed first and the composition last, so it never points at a commit that does not exist; a failed
push raises `HubPushError` naming the module and repo, and pushing again completes it.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from dataclasses import dataclass

from ..core.config import OmniConfig, repo_id_error
from ..files.composition import owner_of_saved
from ..files.folder import adapter_config_with_base, module_paths
from ..files.lora_base import weights_folder
from ..files.module_folder import module_folder
from .cards import composition_card, module_card, read_summary
from .checkpoint_push import folder_operations
from .commit import commit
from .ids import HUB_LAYOUTS
from .link import rebuilds_from_origin

HUB_KEYS = ("push_to_hub", "hub_model_id")  # per-module push settings (`modules.<name>.<key>`)

logger = logging.getLogger(__name__)


@dataclass
class ModulePush:
    name: str
    link: bool              # linked (not uploaded): `repo_id` at `revision`
    repo_id: str            # its own repo (per_module, or linked), or the composition repo (single)
    revision: str | None = None
    folder: str | None = None


def plan_modules(root: str | None, config: OmniConfig, repo_id: str, layout: str, overrides: dict | None
                 ) -> list[ModulePush]:
    """What happens to every module, checked before anything is sent (errors name the module and key)."""
    if layout not in HUB_LAYOUTS:
        raise ValueError(f"hub_layout must be one of {HUB_LAYOUTS}, got {layout!r}")
    overrides = dict(overrides or {})
    unknown = sorted(set(overrides) - set(config.module_names))
    if unknown:
        raise ValueError(f"push: modules {unknown} are not modules of this model {config.module_names}")
    plans = []
    for entry in config.modules:
        name, own = entry.name, overrides.get(entry.name) or {}
        want, own_repo = own.get("push_to_hub"), own.get("hub_model_id")
        origin = entry.hub_repo
        link = want is False or (want is None and entry.trained is False and origin is not None
                                 and root is not None
                                 and rebuilds_from_origin(module_folder(root, config, name), entry.cls, origin,
                                                          entry.hub_revision, entry.processor, name))
        if link:
            target = own_repo or (origin if entry.trained is False else None)
            if target is None:
                raise ValueError(f"module {name!r}: push_to_hub is false but it has no Hub repo to link (it was "
                                 "trained, or not loaded from the Hub): set modules."
                                 f"{name}.hub_model_id to the repo that holds it")
            revision = entry.hub_revision if target == origin else None
            plans.append(ModulePush(name, True, target, revision))
            continue
        target = (own_repo or f"{repo_id}-{name}") if layout == "per_module" else repo_id
        try:
            folder = module_folder(root, config, name) if root is not None else None  # None: a check only
        except (FileNotFoundError, ValueError) as err:
            raise ValueError(f"module {name!r}: nothing to upload ({err})") from None
        plans.append(ModulePush(name, False, target, folder=folder))
    for plan in plans:
        if repo_id_error(plan.repo_id):
            raise ValueError(f"module {plan.name!r}: {plan.repo_id!r} is not a Hub repo id "
                             f"({repo_id_error(plan.repo_id)})")
    targets = [p.repo_id for p in plans if not p.link and layout == "per_module"]
    clash = sorted({t for t in targets if targets.count(t) > 1 or t == repo_id})
    if clash:
        raise ValueError(f"push: modules would share the repos {clash} (with each other or the composition "
                         f"{repo_id}): set distinct modules.<name>.hub_model_id")
    return plans


def module_operations(folder: str, prefix: str, card: str | None, own_repo: str | None = None) -> list:
    """A module folder's HF files (and its card) under `prefix`. In its own repo a LoRA module's adapter config
    names that repo as its base model: the base weights are beside the adapter, and `from_pretrained(repo)` reads
    an adapter's base from `base_model_name_or_path` (a local folder is exempt, a repo is not)."""
    from huggingface_hub import CommitOperationAdd

    ops = []
    apart = weights_folder(folder) != folder  # a LoRA base written apart: its files go beside the adapter
    for n, content in sorted(module_paths(folder).items()):
        if n == "adapter_config.json" and (own_repo is not None or apart):
            content = adapter_config_with_base(folder, own_repo)
        ops.append(CommitOperationAdd(f"{prefix}{n}", content))
    return ops + ([CommitOperationAdd(f"{prefix}README.md", card.encode())] if card is not None else [])


def _root_operations(root: str, entries: list, repo_id: str, config, summary, plans: list, cards: bool) -> list:
    """The composition repo's `config.json` (its module entries as pushed) and, with `cards`, its README."""
    from huggingface_hub import CommitOperationAdd

    with open(os.path.join(root, "config.json")) as f:
        root_config = json.load(f)
    root_config["modules"] = [e.to_dict() for e in entries]  # each checked as any root config's entries
    ops = [CommitOperationAdd("config.json", json.dumps(root_config, indent=2, sort_keys=True).encode())]
    if cards:
        card = composition_card(repo_id, entries, config.omni_class, summary, [p.repo_id for p in plans if p.link])
        ops.append(CommitOperationAdd("README.md", card.encode()))
    return ops


def push_saved(root: str, repo_id: str, **kwargs) -> dict[str, str]:
    """Push the model saved at `root` (an export or a checkpoint) to `repo_id` as its composition pushes one
    (`files.composition.Composition.push`: a plain composition's is `push_composition`); returns `{repo: commit}`."""
    return owner_of_saved(root).push(root, repo_id, **kwargs)


def hub_modules(args) -> dict:
    """`modules.<name>.push_to_hub` / `hub_model_id` of every module that sets them (`args`: the run's arguments)."""
    return {name: {k: overlay[k] for k in HUB_KEYS if k in overlay} for name, overlay in args.modules.items()}


def push_composition(root: str, repo_id: str, *, layout: str | None = None, modules: dict | None = None,
               token: str | None = None, private: bool | None = None, revision: str | None = None,
               commit_message: str = "Upload with hf_omni", extra_folders: dict[str, str] | None = None,
               pushed: dict[str, tuple[str, str]] | None = None, cards: bool = True) -> dict[str, str]:
    """Push the composed model saved at `root` (`config.json` + module folders, or a checkpoint) to `repo_id`.

    `modules`: per-module `{push_to_hub, hub_model_id}`; `extra_folders`: `{path_in_repo: folder}` added to the
    composition's commit (a checkpoint under `last-checkpoint/`); `pushed`: `{module: (repo, commit)}` of modules
    already uploaded unchanged (a frozen module, by an earlier push of this run), updated in place.
    Returns `{repo_id: commit}` of the commits made."""
    from huggingface_hub import HfApi
    from huggingface_hub.utils import tqdm

    layout = layout or "per_module"

    config = OmniConfig.from_pretrained(root)
    plans = plan_modules(root, config, repo_id, layout, modules)
    summary = read_summary(root)
    pushed = pushed if pushed is not None else {}
    api, commits, entries = HfApi(), {}, []
    composition_ops = []
    own = [p for p in plans if not p.link and layout == "per_module"]
    with tqdm(total=len(own) + 1, desc=f"pushing to {repo_id}", unit="repo") as bar:
        for plan in plans:
            entry = dataclasses.replace(config.module_entry(plan.name), source=None)  # no local path leaves
            subfolder = entry.subfolder if layout == "single" and not plan.link else None
            card = module_card(entry, plan.folder, plan.repo_id, repo_id, config.omni_class, summary,
                               subfolder) if cards else None
            if plan.link:
                entry.hub_repo, entry.hub_revision = plan.repo_id, plan.revision
            elif layout == "single":
                composition_ops += module_operations(plan.folder, f"{entry.subfolder}/", card)
                entry.hub_repo, entry.hub_revision = None, None
            else:
                done = pushed.get(plan.name)
                if done is None or done[0] != plan.repo_id or entry.trained is not False:
                    ops = module_operations(plan.folder, "", card, own_repo=plan.repo_id)
                    oid = commit(api, plan.repo_id, ops, commit_message, f"module {plan.name!r}", token, private,
                                 revision)
                    commits[plan.repo_id] = oid
                    pushed[plan.name] = (plan.repo_id, oid)
                entry.hub_repo, entry.hub_revision = plan.repo_id, pushed[plan.name][1]
                bar.update(1)
            entries.append(entry)
        composition_ops += _root_operations(root, entries, repo_id, config, summary, plans, cards)
        checkpoint_ops, checkpoint_prefixes = folder_operations(extra_folders or {})
        composition_ops += checkpoint_ops
        prefixes = tuple(f"{e.subfolder}/" for e in entries) + checkpoint_prefixes
        managed = lambda p: p in ("config.json", "README.md") or p.startswith(prefixes)  # noqa: E731
        commits[repo_id] = commit(api, repo_id, composition_ops, commit_message, "the composition", token, private,
                                  revision, managed=managed)
        bar.update(1)
    return commits
