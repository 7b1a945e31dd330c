"""Every code block of the README and docs/ runs (Sybil), or says which runnable file it is a fragment of.

- `python` blocks run in order, one namespace per page, in a fresh folder, with tiny stand-ins for what a page
  names without building (`vit`, `proj`, `lm`, `tokenizer`, `data`: the demo's modules at test size);
- `yaml` blocks are parsed with `HfArgumentParser(OmniTrainingArguments)` (every per-module key checked); a block
  whose first line is `# <name>.yaml` is also written to that file for the page's next blocks; an Accelerate
  config (`distributed_type:`) is read by Accelerate's own config class;
- a block preceded by `<!-- skip: next "fragment of PATH" -->` is not run: PATH (a file of the repository) is
  where the same code runs, and each of the block's lines must be a line of PATH (of its cells, for a notebook), so
  a fragment cannot drift from its source; any other reason to skip fails;
- other blocks (`bash`, `text`, `{eval-rst}`, ...) are not code to run here: the README's commands are CI's own.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from unittest import SkipTest

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md"] + sorted((ROOT / "docs").glob("*.md"))
FRAGMENT = re.compile(r'^fragment of (\S+)$')


def stand_ins(namespace: dict, text: str) -> None:
    """What the pages name without building it: the demo's modules and data at test size, and tiny released models
    (`qwen`, `blip2`, `omni`, `omni3`, `janus`) for the pages that use them."""
    import torch
    from helpers import tiny_data, tiny_model

    from hf_omni import OmniModel, OmniTrainer, OmniTrainingArguments, offline_encoder

    base = tiny_model()  # and the README's imports, which the pages' shorter blocks take as given
    namespace.update(torch=torch, OmniModel=OmniModel, OmniTrainer=OmniTrainer,
                     OmniTrainingArguments=OmniTrainingArguments, offline_encoder=offline_encoder, vit=base.vision, proj=base.projector, lm=base.llm, tokenizer=base.processors["llm"],
                     data=tiny_data(base, 16))
    from released_models import BUILDERS

    for name, family in (("qwen", "qwen2_5_vl"), ("blip2", "blip2")):
        if re.search(rf"\b{name}\b", text):
            namespace[name] = BUILDERS[family]()
    import omni_models

    for name, build in (("omni", omni_models.qwen2_5_omni), ("omni3", omni_models.qwen3_omni),
                        ("janus", omni_models.janus)):
        if re.search(rf"\b{name}\b", text):
            namespace[name] = build()


def fragment_lines(path: Path) -> set[str]:
    """The stripped lines of a runnable file (a notebook's: its cells' sources)."""
    text = path.read_text()
    if path.suffix == ".ipynb":
        text = "\n".join("".join(cell["source"]) for cell in json.loads(text)["cells"])
    return {line.strip() for line in text.splitlines()}


def check_yaml(example) -> None:
    from transformers import HfArgumentParser

    from hf_omni import OmniTrainingArguments

    text = example.parsed
    values = yaml.safe_load(text)
    first = text.lstrip().splitlines()[0]
    if "distributed_type" in values:  # an Accelerate config file, read as `accelerate launch` reads it
        from accelerate.commands.config.config_args import load_config_from_file

        Path("accelerate_config.yaml").write_text(text)
        load_config_from_file("accelerate_config.yaml")
    else:
        HfArgumentParser(OmniTrainingArguments).parse_dict({"output_dir": "out", **values})
    named = re.match(r"#\s*(\S+\.ya?ml)\b", first)
    if named:
        Path(named.group(1)).write_text(text)


def sybil():
    from sybil import Sybil
    from sybil.parsers.markdown import CodeBlockParser, PythonCodeBlockParser, SkipParser

    return Sybil(parsers=[SkipParser(), PythonCodeBlockParser(), CodeBlockParser("yaml", check_yaml)])


@pytest.mark.parametrize("page", PAGES, ids=[p.name for p in PAGES])
def test_every_block_of_the_page_runs(page, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    document = sybil().parse(page)
    stand_ins(document.namespace, page.read_text())
    ran = 0
    for example in document.examples():
        try:
            example.evaluate()
            ran += 1
        except SkipTest as skipped:
            match = FRAGMENT.match(str(skipped))
            assert match, f"{page.name}:{example.line}: a block is skipped only as 'fragment of PATH': {skipped}"
            source = ROOT / match.group(1)
            assert source.exists(), f"{page.name}:{example.line}: {match.group(1)} does not exist"
            missing = [line.strip() for line in fenced_after(page, example.line) if line.strip()
                       and line.strip() not in fragment_lines(source)]
            assert not missing, f"{page.name}:{example.line}: lines not in {match.group(1)}: {missing[:3]}"
        except Exception as err:
            raise AssertionError(f"{page.name}:{example.line}: {type(err).__name__}: {err}") from err
    document.namespace.clear()


def fenced_after(page: Path, line: int) -> list[str]:
    """The lines of the fenced block that starts at or after a page's line (1-based): what a skip marker names."""
    lines = page.read_text().splitlines()[line - 1:]
    start = next(i for i, text in enumerate(lines) if text.startswith("```"))
    end = next(i for i in range(start + 1, len(lines)) if lines[i].startswith("```"))
    return lines[start + 1:end]
