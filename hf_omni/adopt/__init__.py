"""Released composite models adopted as they are (`OmniModel.from_model`; the composition: `compositions/adopted.py`):
the model over the released one (`model`), its modules carved out of it by attribute path (`parts`) and who owns
each tensor (`owners`), the adopted part as a module format (`format`), the names of what its saves hold (`saved`),
writing it in the released format (`export`), its encoder methods served from the offline cache (`offline`), the
same-inputs check of a forward every rank must join (`inputs`), its one Hub repo (`hub_push`), and the training
steps of releases whose class has none (`omni`: `omni/step` their base, `omni/qwen2_5_omni` Qwen2.5-Omni's)."""
