"""The tests that serve each cell of docs/parallel.md's layout x feature matrix: {layout: {feature: (test file,
scenario)}}; a cell no test serves is declared by the layout (`Layout.notes`: refused by name, or not applying).
tests/test_layout_matrix.py checks that every cell is one or the other and that each scenario named exists;
docs/parallelism_keys.py writes the table."""

TESTED = {
    "tp": {
        "LoRA": ("test_tp.py", "dp2_tp2_lora"),
        "EMA": ("test_tp.py", "dp2_tp2"),
        "bf16, fp32 masters": ("test_tp.py", "tp2_bf16"),
        "activation checkpointing": ("test_tp.py", "tp2_accumulation_ac"),
        "accumulation": ("test_tp.py", "tp2_accumulation_ac"),
        "HSDP": ("test_layouts_8.py", "hsdp_tp"),
        "elastic resume": ("test_tp.py", "dp2_tp2_to_dp4"),
        "empty_init": ("test_tp.py", "empty_init_tp2"),
        "generate": ("test_tp.py", "tp2"),
        "missing modality": ("test_mesh_multiprocess.py", "missing_modality_tp"),
        "adopted model": ("test_adopted_multiprocess.py", "llava_tp2"),
        "loss from labels": ("test_tp.py", "dp2_tp2_labels"),
        "tied embeddings": ("test_tp.py", "tp2_tied"),
        "the other layout": ("test_tp.py", "dp2_tp2_ep2"),
    },
    "ep": {
        "LoRA": ("test_tp.py", "dp4_ep2_lora"),
        "EMA": ("test_tp.py", "dp4_ep2"),
        "bf16, fp32 masters": ("test_tp.py", "ep2_bf16"),
        "activation checkpointing": ("test_tp.py", "ep2"),
        "accumulation": ("test_tp.py", "ep2"),
        "HSDP": ("test_tp.py", "hsdp_ep2"),
        "elastic resume": ("test_tp.py", "dp4_ep2_to_ep2"),
        "empty_init": ("test_tp.py", "empty_init_ep2"),
        "generate": ("test_tp.py", "ep2"),
        "missing modality": ("test_mesh_multiprocess.py", "missing_modality_ep"),
        "adopted model": ("test_adopted_experts.py", "qwen2_moe"),
        "the other layout": ("test_tp.py", "dp2_tp2_ep2"),
    },
    "sp": {
        "LoRA": ("test_tp.py", "sp2_lora"),
        "EMA": ("test_tp.py", "dp2_sp2_labels"),
        "bf16, fp32 masters": ("test_tp.py", "sp2_bf16"),
        "activation checkpointing": ("test_tp.py", "sp2_accumulation_ac"),
        "accumulation": ("test_tp.py", "sp2_accumulation_ac"),
        "HSDP": ("test_layouts_8.py", "hsdp_sp"),
        "elastic resume": ("test_tp.py", "dp2_sp2_to_dp2"),
        "empty_init": ("test_tp.py", "empty_init_sp2"),
        "missing modality": ("test_mesh_multiprocess.py", "missing_modality_sp"),
        "adopted model": ("test_adopted_multiprocess.py", "llava_sp2"),
        "loss from labels": ("test_tp.py", "dp2_sp2_labels"),
        "diffusers denoiser": ("test_diffusion.py", "wan_sp2"),
    },
}


def scenarios() -> set[str]:
    """Every scenario name the multi-rank tests run (their registries)."""
    import adopted_experts
    import mesh_scenarios
    import tp_scenarios
    from scripts import mp_adopted, mp_diffusion, mp_layouts_8

    return {*tp_scenarios.SCENARIOS, *tp_scenarios.ELASTIC, *(f"empty_init_{n}" for n in ("tp2", "ep2", "sp2")),
            *mesh_scenarios.SCENARIOS, *mp_layouts_8.LAYOUTS, *mp_adopted.CASES, *adopted_experts.FAMILIES,
            *mp_diffusion.SCENARIOS}


def cell(layout, feature: str) -> str:
    """The matrix's cell: "yes: `scenario` (test file)", or the layout's own note."""
    tested = TESTED.get(layout.name, {}).get(feature)
    if tested is not None:
        return f"yes: `{tested[1]}` ({tested[0]})"
    return layout.notes.get(feature, "")


def rows() -> list[str]:
    """docs/parallel.md's layout x feature matrix, a row per feature, a column per registered layout."""
    import hf_omni  # noqa: F401 (registers every layout)
    from hf_omni.parallel.layout import FEATURES, LAYOUTS

    layouts = list(LAYOUTS.own())
    out = ["| feature | " + " | ".join(f"`{cls.size_key}`" for cls in layouts) + " |",
           "|---|" + "---|" * len(layouts)]
    for feature in FEATURES:
        out.append(f"| {feature} | " + " | ".join(cell(cls, feature) for cls in layouts) + " |")
    return out
