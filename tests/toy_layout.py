"""A toy layout, the recipe of docs/how_it_works.md "Add a layout": `parallelism: {toy_size: R}` adds a dim `toy` of
R ranks beside `dp_replicate`, a data dim FSDP2 replicates over (HSDP on `(toy, dp_shard)`), and splits nothing: no
`apply`, no boundary. One file plus one `register_layout`; the module's dimensions, mesh, refusals and key table
follow from the declaration."""

from hf_omni import Layout, register_layout


@register_layout
class ToyLayout(Layout):
    name = "toy"  # `parallelism.toy_size`, mesh dim `toy`
    description = "toy replicas (a test of the layout extension point)"
    dim = "replicate"  # beside dp_replicate: each rank its own batch, gradients all-reduced over the dim
