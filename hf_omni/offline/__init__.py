"""Offline encoding and missing modalities: a module's entry point (`encoder`, declared as `spec`), its cache
(`cache`, ragged outputs in `ragged`), serving rows from caches (`serve`), ranks whose batch lacks a module's input
(`missing_modality`, running the method on a `dummy`: one exchange per forward, `forward_plan`, over `exchange`,
or per accumulation window, `window`), and batches that agree on their modalities (`modality_sampler`)."""
