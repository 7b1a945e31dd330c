"""A module's place in the composed model and what is kept about it: its slot (`slot`), its master weights and
compute dtype (`precision`), its EMA weights (`ema`), its input embeddings (`embeddings`), a module made of another
model's submodules (`units`), and the check that every tensor has one owner (`ownership`)."""
