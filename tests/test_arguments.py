"""OmniTrainingArguments: parsing (YAML / JSON / CLI), merge rules and every validation error."""

import json

import pytest
import torch
from helpers import make_args, tiny_data, tiny_model
from transformers import HfArgumentParser

from hf_omni import OmniPlugin, OmniTrainer, OmniTrainingArguments

YAML = """
output_dir: {out}
learning_rate: 1e-4
use_cpu: true
lora: {{r: 8, lora_alpha: 16, target_modules: [q_proj, v_proj]}}
fsdp_plugin: {{reshard_after_forward: true, mixed_precision: bf16}}
activation_checkpointing: true
max_grad_norm: 2.0
modules:
  vision:
    trainable: false
  projector:
    learning_rate: 1e-3
    lora: null
  llm:
    lora: {{r: 4, target_modules: [k_proj]}}
    fsdp_plugin: {{transformer_cls_names_to_wrap: [LlamaDecoderLayer], mixed_precision: null}}
    warmup_steps: 0.05
    max_grad_norm: null
"""


def test_yaml_numbers_and_merge_rules(tmp_path):
    path = tmp_path / "train.yaml"
    path.write_text(YAML.format(out=tmp_path))
    (args,) = HfArgumentParser(OmniTrainingArguments).parse_yaml_file(str(path))
    assert args.learning_rate == 1e-4 and isinstance(args.learning_rate, float)
    m = args.resolve_modules(["vision", "projector", "llm"])
    assert not m["vision"].trainable and m["vision"].lora is None          # trainable: false drops lora
    assert m["projector"].learning_rate == 1e-3 and m["projector"].lora is None   # null removes
    assert m["llm"].lora == {"r": 4, "lora_alpha": 16, "target_modules": ["k_proj"]}  # dict merge, list replace
    assert m["llm"].lora_from_module and not m["projector"].lora_from_module
    assert m["llm"].fsdp_plugin == {"reshard_after_forward": True,
                                    "transformer_cls_names_to_wrap": ["LlamaDecoderLayer"]}
    assert m["llm"].warmup_steps == 0.05 and m["llm"].warmup_steps_for(100) == 5
    assert m["llm"].max_grad_norm == 0.0 and m["projector"].max_grad_norm == 2.0
    assert all(x.activation_checkpointing for x in m.values())
    assert args.activation_checkpointing is False  # Trainer never checkpoints the composed model as a whole


def test_json_and_cli(tmp_path):
    path = tmp_path / "train.json"
    path.write_text(json.dumps({"output_dir": str(tmp_path), "modules": {"llm": {"learning_rate": "2e-3"}}}))
    (args,) = HfArgumentParser(OmniTrainingArguments).parse_json_file(str(path))
    assert args.resolve_modules(["llm"])["llm"].learning_rate == 2e-3
    (cli,) = HfArgumentParser(OmniTrainingArguments).parse_args_into_dataclasses(
        args=["--output_dir", str(tmp_path), "--modules", '{"llm": {"optim": "sgd"}}', "--parallel", "none"])
    assert cli.resolve_modules(["llm"])["llm"].optim == "sgd"
    assert cli.resolve_modules(["llm"])["llm"].parallel == "none"


def test_global_engines_refused_naming_the_per_module_key(tmp_path):
    from accelerate.parallelism_config import ParallelismConfig

    with pytest.raises(ValueError, match=r"^parallelism_config: .*modules\.<name>"):
        OmniTrainingArguments(output_dir=str(tmp_path), parallelism_config=ParallelismConfig())
    with pytest.raises(ValueError, match=r"^deepspeed: .*modules\.<name>\.parallel"):
        OmniTrainingArguments(output_dir=str(tmp_path), deepspeed={})


def test_activation_checkpointing_is_accepted(tmp_path):
    args = OmniTrainingArguments(output_dir=str(tmp_path), activation_checkpointing=True)
    assert args.module_activation_checkpointing


def test_cli_refuses_gradient_checkpointing(tmp_path):
    with pytest.raises(ValueError, match="^gradient_checkpointing: use `activation_checkpointing`"):
        HfArgumentParser(OmniTrainingArguments).parse_args_into_dataclasses(
            args=["--output_dir", str(tmp_path), "--gradient_checkpointing", "true"])


MODEL_ERRORS = [
    (dict(modules={"text_encoder": {"learning_rate": 1e-3}}), "modules.text_encoder",
     "['vision', 'projector', 'llm']"),
    (dict(modules={n: {"trainable": False} for n in ("vision", "projector", "llm")}), "modules", "nothing is trainable"),
]


@pytest.mark.parametrize("overrides,where,detail", MODEL_ERRORS)
def test_model_time_errors_before_any_compute(tmp_path, overrides, where, detail):
    model = tiny_model()
    with pytest.raises(ValueError) as err:
        OmniTrainer(model=model, args=make_args(tmp_path, **overrides), train_dataset=tiny_data(model))
    assert str(err.value).startswith(where) and detail in str(err.value), str(err.value)


def test_module_lora_matching_nothing_is_an_error(tmp_path):
    model = tiny_model()
    args = make_args(tmp_path, modules={"projector": {"lora": {"r": 2, "target_modules": ["q_proj"]}}})
    trainer = OmniTrainer(model=model, args=args, train_dataset=tiny_data(model))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=r"^modules\.projector\.lora: matches no layer"):
        trainer.train()
    assert all(v.equal(before[k]) for k, v in model.state_dict().items())  # before any step


def test_missing_num_training_steps_names_module(tmp_path):
    from accelerate import Accelerator

    plugin = OmniPlugin(modules={"vision": {"trainable": False}}, output_dir=str(tmp_path))
    with pytest.raises(ValueError, match=r"^modules\.projector\.lr_scheduler_type"):
        plugin.prepare(Accelerator(cpu=True), tiny_model())


def test_plugin_defaults_unknown_key(tmp_path):
    with pytest.raises(ValueError, match="^learning_rat:"):
        OmniPlugin(defaults={"learning_rat": 1e-3})


def test_tensors_owned_by_the_composed_model_are_refused(tmp_path):
    model = tiny_model()
    model.query = torch.nn.Parameter(torch.zeros(4))
    with pytest.raises(ValueError, match=r"Captioner owns tensors outside every module: \['query'\].*put them in a module"):
        OmniTrainer(model=model, args=make_args(tmp_path), train_dataset=tiny_data(model))


def test_other_peft_methods_are_refused(tmp_path):
    from peft import IA3Config, inject_adapter_in_model

    model = tiny_model()
    inject_adapter_in_model(IA3Config(target_modules=["q_proj"], feedforward_modules=[]), model.llm)
    trainer = OmniTrainer(model=model, args=make_args(tmp_path), train_dataset=tiny_data(model))
    with pytest.raises(ValueError, match=r"^modules\.llm\.lora: adapter 'default' is a IA3Config"):
        trainer.train()


def test_trainer_refuses_optimizers(tmp_path):
    import torch

    model = tiny_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="^optimizers="):
        OmniTrainer(model=model, args=make_args(tmp_path), optimizers=(opt, None))
