"""Shares: how a tensor maps onto this rank's share of it, for reading and writing files. `box` gives the box of
the global tensor a DTensor holds (`Shard(dim)` placements, nested ones included), copies values into it and views
it as dim-0 shards for row-major writers; `replicas` reads each byte once under HSDP and DDP (one replica reads, the
others receive). Below both file I/O (`modules/`, `checkpoint/`) and the strategies (`parallel/`), importing
neither."""
