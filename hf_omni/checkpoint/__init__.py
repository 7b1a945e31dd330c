"""Checkpoints: the checkpointer (`checkpointer`), the files and marker (`files`), one module's resume state
(`module_state`), the async save (`async_save`), the shard writer (`shard_writer`), RNG states (`rng`)."""
