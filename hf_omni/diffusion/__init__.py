"""Diffusers pipelines as composed models (`pipeline`), their LoRA in diffusers' own file (`lora_file`) and sample
images logged while training (`sampling`); diffusers models as modules are a module format
(`formats/diffusers_models.py`)."""
