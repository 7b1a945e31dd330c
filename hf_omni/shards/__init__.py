"""Shares: how a tensor maps onto this rank's share of it, for reading and writing files. `box` gives the box of
the global tensor a DTensor holds (`Shard(dim)` placements, nested ones included), copies values into it and views
it as dim-0 shards for row-major writers; `replicas` reads each byte once under HSDP and DDP (one replica reads, the
others receive); `device` hands tensors to a collective on the device its group serves. Below both file I/O
(`files/`, `checkpoint/`) and the strategies (`parallel/`), importing neither."""
