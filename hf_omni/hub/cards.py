"""Model cards for a pushed composition: one per module repo and one for the composition repo.

Built with `huggingface_hub.ModelCard` / `ModelCardData`, from what the push knows: the root config (classes,
links), each module's folder (its LoRA config) and the run's `training_summary.json` (per-module
hyper-parameters, final metrics; written by `OmniTrainer`, holding no argument beyond those). Never a token.
"""

from __future__ import annotations

import json
import os

from ..checkpoint.marker import read_json
from ..files.format import format_of, resolve_class

SUMMARY = "training_summary.json"  # written by OmniTrainer beside an export's / checkpoint's root config
HYPER_PARAMETERS = ("learning_rate", "optim", "weight_decay", "lr_scheduler_type", "warmup_steps", "max_grad_norm",
                    "parallel")


def read_summary(root: str) -> dict:
    """The run's summary beside `root/config.json`, or `{}` (an export saved without OmniTrainer)."""

    path = os.path.join(root, SUMMARY)
    return read_json(path) if os.path.isfile(path) else {}


def how_trained(entry, folder: str | None, summary: dict) -> str:
    """How module `entry` (a `ModuleEntry`) was trained, from its adapter, the run's summary or its entry."""
    settings = summary.get("modules", {}).get(entry.name, {})
    lora_path = os.path.join(folder, "adapter_config.json") if folder else None
    lora = settings.get("lora")
    if lora_path and os.path.isfile(lora_path):
        with open(lora_path) as f:
            lora = json.load(f)
    if lora:
        shown = {k: lora.get(k) for k in ("r", "lora_alpha", "lora_dropout", "target_modules", "use_dora",
                                          "modules_to_save") if lora.get(k) not in (None, False)}
        return "LoRA (adapters beside the base weights): `" + json.dumps(shown, sort_keys=True) + "`"
    if entry.trained is False or settings.get("trainable") is False:
        return "frozen (not trained in this run)"
    return "full fine-tuning" if entry.trained or settings.get("trainable") else "not recorded"


def card_text(data, body: str) -> str:
    """Front matter from `ModelCardData` (validated YAML) and the body, as a `ModelCard`'s content."""
    from huggingface_hub import ModelCard

    return str(ModelCard(f"---\n{data.to_yaml()}\n---\n\n{body}\n"))


def metrics_table(summary: dict) -> list[str]:
    metrics = summary.get("metrics") or {}
    if not metrics:
        return ["No metrics were recorded."]
    return ["| metric | value |", "|---|---|"] + [f"| {k} | {v:.6g} |" if isinstance(v, float) else f"| {k} | {v} |"
                                                   for k, v in sorted(metrics.items())]


def load_snippet(composition_repo: str, omni_class: str | None) -> str:
    own = f"  # or your subclass ({omni_class}) for its forward" if omni_class not in (None, "OmniModel") else ""
    return f'from hf_omni import OmniModel\n\nmodel = OmniModel.from_pretrained("{composition_repo}"){own}'


def alone_snippet(fmt, record: str, repo_id: str, subfolder: str | None, lora: bool) -> list[str]:
    """How the module loads alone: its format's lines (`ModuleFormat.card_usage`: a transformers module's Auto
    class)."""
    if subfolder and lora:  # transformers reads an adapter's base from the repo root, not the subfolder
        return ["In this layout the LoRA module loads through the composition (below).", ""]
    return fmt.card_usage(record, repo_id, subfolder)


def module_card(entry, folder: str | None, repo_id: str, composition_repo: str, omni_class: str | None,
                summary: dict, subfolder: str | None = None) -> str:
    """The card of module `entry` pushed to `repo_id` (its own repo, or `subfolder` of the composition's)."""
    from huggingface_hub import ModelCardData

    name, cls = entry.name, entry.cls
    fmt = format_of(resolve_class(cls, name))
    trained = how_trained(entry, folder, summary)
    origin = entry.hub_repo if entry.hub_repo != repo_id else None
    tags = ["hf_omni", f"hf_omni-module-{name}"] + (["lora", "peft"] if trained.startswith("LoRA") else [])
    data = ModelCardData(library_name=fmt.library_name, tags=tags, base_model=origin,
                         model_name=repo_id.split("/")[-1])
    settings = summary.get("modules", {}).get(name, {}) if not trained.startswith("frozen") else {}
    rows = ["| hyper-parameter | value |", "|---|---|"] + [f"| {k} | `{settings[k]!r}` |" for k in HYPER_PARAMETERS
                                                          if k in settings]
    base = f"[`{origin}`](/{origin})" + (f" at `{entry.hub_revision}`" if entry.hub_revision else "")
    body = [f"# {repo_id}", "",
            f"Module `{name}` (`{cls}`) of the composed model [`{composition_repo}`](/{composition_repo}), pushed "
            "with hf_omni.", "",
            f"- **Training:** {trained}", f"- **Base model:** {base if origin else 'none recorded (built locally)'}",
            f"- **Steps:** {summary.get('global_step', 'not recorded')}", "",
            "## Hyper-parameters", "", *(rows if settings else ["None (not trained)." if trained.startswith(
                "frozen") else "Not recorded."]), "",
            "## Final metrics (the whole composition)", "", *metrics_table(summary), "",
            "## Use", "", *alone_snippet(fmt, cls, repo_id, subfolder, trained.startswith("LoRA")),
            "The whole composition:", "", "```python", load_snippet(composition_repo, omni_class), "```"]
    return card_text(data, "\n".join(body))


def composition_card(repo_id: str, entries: list, omni_class: str | None, summary: dict,
                     linked: list[str]) -> str:
    """The composition repo's card: a table of modules with where each one lives (`linked`: the repos of modules
    linked, not uploaded — its base models)."""
    from huggingface_hub import ModelCardData

    linked = sorted(set(linked))
    data = ModelCardData(tags=["hf_omni", "composed-model"], base_model=linked[0] if len(linked) == 1 else linked or None,
                         model_name=repo_id.split("/")[-1])
    rows = ["| module | class | where | training |", "|---|---|---|---|"]
    for e in entries:
        where = (f"[`{e.hub_repo}`](/{e.hub_repo})" + (f" @ `{e.hub_revision[:12]}`" if e.hub_revision else "")
                 ) if e.hub_repo else f"`{e.subfolder}/` in this repo"
        rows.append(f"| `{e.name}` | `{e.cls}` | {where} | {how_trained(e, None, summary)} |")
    body = [f"# {repo_id}", "", f"A composed model (`{omni_class}`) of {len(entries)} modules, trained with "
            "hf_omni. Each module is an ordinary Hugging Face model.", "",
            *rows, "", "## Final metrics", "", *metrics_table(summary), "", "## Use", "", "```python",
            load_snippet(repo_id, omni_class), "```"]
    return card_text(data, "\n".join(body))


def write_summary(directory: str, module_args: dict, log_history: list[dict], global_step: int) -> None:
    """`training_summary.json`: each module's settings (`ModuleArguments` keys only: never a token or any other
    argument) and the run's last value of each metric."""
    modules = {name: {k: getattr(m, k) for k in ("trainable", "lora", *HYPER_PARAMETERS)}
               for name, m in module_args.items()}
    skipped = ("runtime", "per_second", "grad_norm", "learning_rate", "total_flos", "step")
    metrics = {}
    for record in log_history:
        metrics.update({k: v for k, v in record.items() if isinstance(v, (int, float)) and "/" not in k
                        and not any(s in k for s in skipped)})
    with open(os.path.join(directory, SUMMARY), "w") as f:
        json.dump({"modules": modules, "metrics": metrics, "global_step": global_step}, f, indent=2, sort_keys=True)
