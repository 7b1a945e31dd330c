"""Arguments: one module's settings, every per-module key declared once (`module`), the training arguments with
their `modules:` overlays (`training`), and the fate of every TrainingArguments field (`fields`)."""
