"""A module as a Hugging Face folder, and a composed model as a folder of them. What a kind of module is
(`format`: `ModuleFormat` and its registry) and a kind of composition (`composition`); one module's folder written,
loaded and copied (`folder`), planned from metadata alone (`folder_plan`), written by every rank in place
(`folder_write`, its bytes through `in_place`, its small files `folder_metadata`, its derived groups
`folder_derived`), where each tensor is saved (`saved_keys`); reading it back (`weights`, `safetensors_index`,
fused MoE rows `expert_rows`), built on meta first (`empty_init`, `meta`); LoRA bases written apart (`lora_base`),
LoRA merged by PEFT itself (`peft_merge`); whole copies bounded (`whole`); and where a saved composition's module is
(`module_folder`)."""
