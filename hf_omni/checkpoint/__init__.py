"""Checkpoints: the checkpointer (`checkpointer`) and reading one back (`resume`); what a checkpoint holds and its
whole-checkpoint check (`contents`), its completion marker (`marker`), each file's first-bytes check
(`file_checks`) and sha256s (`digests`); one module's resume state (`module_state`: DCP shards through
`shard_writer` / `shard_reader`, planned alone for async saves by `shard_plan`; the optimizer's JSON half,
`state_json`); LoRA bases written once per run (`bases`); async saves (`async_save`: host copies in `staging`,
files written by `writer_process`); RNG states (`rng`); and `hf-omni export` of EMA weights (`ema_export`)."""
