"""What trains inside a module, applied before any strategy wraps it: freezing and LoRA (`modes`), activation
checkpointing through the module's own models (`checkpointing`)."""
