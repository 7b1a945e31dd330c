"""Diffusers pipelines as composed models (`pipeline`; the composition: `compositions/pipeline.py`): their
`model_index.json` and component classes (`index`), their LoRA in diffusers' own file (`lora_file`), their one Hub
repo (`hub_push`) and sample images logged while training (`sampling`); diffusers models as modules are a module
format (`formats/diffusers_models.py`)."""
