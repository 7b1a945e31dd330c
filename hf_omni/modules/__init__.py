"""A module's place in the composed model and what is kept about it: its slot (`slot`), its master weights and
compute dtype (`precision`), its EMA weights (`ema`), its input embeddings (`embeddings`), a module made of another
model's submodules (`units`), the check that every tensor has one owner (`ownership`), and the plugin's per-module
views of the slots (`views`)."""
