"""Checkpoints: the checkpointer (`checkpointer`), the files and marker (`files`), one module's resume state
(`module_state`), the async save pipeline (`pipeline`), the shard writer (`shard_writer`), RNG states (`rng`)."""
