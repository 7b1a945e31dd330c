"""LoRA, in one place: a module's PEFT adapters and their keys (`adapters`), injecting them (`inject`), and merging
adapters into exports row by row (`merge`); a LoRA base written apart and PEFT's own merge are file I/O
(`files/lora_base.py`, `files/peft_merge.py`)."""
