"""LoRA, in one place: a module's PEFT adapters and their keys (`adapters`), injecting them (`inject`), a LoRA
module's frozen base written once per run (`base`), and merging adapters into exports row by row (`merge`)."""
