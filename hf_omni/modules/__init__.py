"""Modules: one module's slot in the composed model (`slot`), a module as a Hugging Face folder (`folder`, `lora`),
where its class comes from (`classes`), how it is built on meta and read back (`empty_init`, `weights`), and the
`Projector` model."""
