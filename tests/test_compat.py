"""The private third-party internals hf_omni relies on (hf_omni/compat/) still exist and behave as it expects;
and the package's own layout rules (no underscore imports across files, no silent excepts, small files)."""

import ast
import os
import re

import pytest
import torch
from helpers import tiny_model

from hf_omni import Projector, ProjectorConfig, compat

PACKAGE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "hf_omni")


@pytest.mark.parametrize("library,path", compat.PRIVATE_SYMBOLS, ids=[p for _, p in compat.PRIVATE_SYMBOLS])
def test_private_symbol_exists_in_installed_version(library, path):
    compat.resolve(path, library)


def test_a_missing_internal_fails_loudly_naming_library_and_symbol():
    with pytest.raises(compat.MissingInternalError, match=r"transformers's private `transformers\.Trainer\._gone`"):
        compat.resolve("transformers.Trainer._gone")
    with pytest.raises(compat.MissingInternalError, match=r"torch's private `torch\.distributed\._no_such_module\.x`"):
        compat.resolve("torch.distributed._no_such_module.x")
    assert compat.missing_symbols() == []


def test_peft_still_reports_an_unmatched_lora_by_its_message():
    from peft import LoraConfig

    model = tiny_model()
    assert compat.inject_lora(LoraConfig(r=2, target_modules=["q_proj"]), model.llm)
    assert not compat.inject_lora(LoraConfig(r=2, target_modules=["q_proj"]), model.projector)
    with pytest.raises(ValueError, match="not supported"):  # any other PEFT error still raises
        compat.inject_lora(LoraConfig(r=2, target_modules=["act"]), tiny_model().projector)


def test_transformers_still_renames_vit_keys_on_save():
    vision = tiny_model().vision
    params = dict(vision.named_parameters())
    saved = compat.transformers_save_keys(vision, params)
    query = params["layers.0.attention.q_proj.weight"]
    assert saved["encoder.layer.0.attention.attention.query.weight"] is query  # renamed, same tensor
    projector = Projector(ProjectorConfig(4, 4))
    assert compat.transformers_save_keys(projector, projector.state_dict()).keys() == projector.state_dict().keys()


def test_trainer_decay_names_and_registered_auto_classes():
    model = tiny_model()
    decay = compat.decay_parameter_names(model.llm)
    assert "model.layers.0.self_attn.q_proj.weight" in decay
    assert not any("norm" in n or n.endswith("bias") for n in decay)
    assert Projector in compat.registered_auto_classes()
    assert len(compat.in_place_wrapper_classes()) == 2


def test_init_weights_and_adapter_adoption_touch_what_transformers_reads():
    projector = Projector(ProjectorConfig(4, 4))
    layer = projector.layers[0]
    torch.nn.init.zeros_(layer.weight)
    compat.init_weights(projector, layer)
    assert layer.weight.abs().sum() > 0
    compat.adopt_loaded_adapter(projector)
    assert projector._hf_peft_config_loaded is False


def _sources():
    for root, _, files in os.walk(PACKAGE):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(root, name)
                with open(path) as f:
                    yield os.path.relpath(path, PACKAGE), f.read()


def test_package_layout_rules():
    for rel, text in _sources():
        assert text.count("\n") <= 250, f"{rel} has {text.count(chr(10))} lines (limit ~250: one job per file)"
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ImportFrom) and node.level > 0:
                private = [a.name for a in node.names if a.name.startswith("_")]
                assert not private, f"{rel} imports private {private} from .{node.module or ''}"
            if isinstance(node, ast.ExceptHandler):
                broad = node.type is None or (isinstance(node.type, ast.Name) and
                                              node.type.id in ("Exception", "BaseException"))
                reraises = any(isinstance(n, ast.Raise) for n in ast.walk(node))
                assert not broad or reraises, f"{rel}:{node.lineno} catches everything and does not re-raise"


def test_configuration_page_holds_the_generated_key_tables():
    from hf_omni.arguments.module import MODULE_KEYS, key_table
    from hf_omni.arguments.training import top_level_table

    with open(os.path.join(os.path.dirname(PACKAGE), "docs", "configuration.md")) as f:
        page = f.read()
    assert key_table() in page, "docs/configuration.md's key table is not hf_omni.arguments.module.key_table()"
    assert top_level_table() in page, "docs/configuration.md's top-level table is not top_level_table()"
    documented = re.findall(r"^\| `(\w+)` \| `", page.split("| key | default |")[1].split("\n\n")[0], re.M)
    assert tuple(documented) == MODULE_KEYS


def test_dataset_fingerprint_follows_every_transform():
    from datasets import Dataset

    data = Dataset.from_dict({"x": [1, 2, 3]})
    first = compat.dataset_fingerprint(data)
    assert isinstance(first, str) and compat.dataset_fingerprint(data.map(lambda r: {"x": r["x"] + 1})) != first
    assert compat.dataset_fingerprint(data.shuffle(seed=0)) != first and compat.dataset_fingerprint([1, 2]) is None
