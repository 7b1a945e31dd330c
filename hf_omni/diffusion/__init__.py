"""Diffusers pipelines as composed models (`pipeline`), their LoRA in diffusers' own file (`lora_file`) and sample images logged while training (`sampling`)."""
