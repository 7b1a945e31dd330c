"""Per-module meshes at 4 ranks (tests/scripts/mp_mesh.py) against 1 rank (tests/test_mesh_multiprocess.py):
each module full shard, HSDP 2x2 or replicated (DDP) in one model, with global and per-module clipping; the
same global batch (2 per rank x 4, 8 at 1 rank)."""

import helpers

HSDP = {"dp_replicate_size": 2, "dp_shard_size": 2}
LLM = {"learning_rate": 1e-3, "parallel": "fsdp"}
MIXED = {  # three meshes in one model: vision full shard over 4, projector HSDP 2x2, llm HSDP 2x2 (shared mesh)
    "vision": {"learning_rate": 1e-3, "parallel": "fsdp", "parallelism": {"dp_shard_size": 4}},
    "projector": {"learning_rate": 3e-3, "parallel": "fsdp", "parallelism": HSDP},
    "llm": {**LLM, "parallelism": HSDP},
}
REPLICATED = {  # llm replicated (DDP), projector full shard, vision HSDP; each clipped to its own limit
    "vision": {"learning_rate": 1e-3, "parallel": "fsdp", "parallelism": HSDP, "max_grad_norm": 0.2},
    "projector": {"learning_rate": 3e-3, "parallel": "fsdp", "max_grad_norm": 0.05},
    "llm": {"learning_rate": 1e-3, "parallel": "ddp", "max_grad_norm": 0.5},
}
MISSING = {"vision": {"learning_rate": 1e-3, "parallel": "fsdp"}, "projector": {"learning_rate": 3e-3, "parallel": "ddp"},
           "llm": {**LLM, "parallelism": HSDP}}
COMMON = dict(max_steps=4)
MULTI, SINGLE = dict(per_device_train_batch_size=2, ddp_timeout=1234), dict(per_device_train_batch_size=8)


def scenario(modules, model="tiny_model", atol=1e-5, **extra):
    return helpers.scenario(modules, MULTI, SINGLE, COMMON, model, atol, **extra)


# elastic resume: mixed_global_clip's checkpoint-2 (4 ranks; vision full shard, projector and llm HSDP 2x2) resumed
# at 2 ranks with every module full shard over both (the same global batch), saving each step (a resumed Trainer
# takes save_steps from the checkpoint's trainer_state.json)
ELASTIC = dict(COMMON, modules={name: {k: v for k, v in margs.items() if k != "parallelism"}
                                for name, margs in MIXED.items()},
               per_device_train_batch_size=4, grad_clip_scope="global", max_grad_norm=0.05, save_strategy="steps",
               save_steps=1)


def build(spec):
    """(model, train dataset, data collator or None) of a scenario."""
    import mixed_modality

    if spec["model"] == "mixed_model":
        model = mixed_modality.mixed_model()
        return model, mixed_modality.MixedCaptions(model), mixed_modality.collate
    if spec["model"] == "dropping_model":
        model = mixed_modality.mixed_model(mixed_modality.DroppingCaptioner)
        return model, mixed_modality.MixedCaptions(model, mixed_modality.ACCUMULATION), mixed_modality.collate
    if spec["model"] in ("token_image_model", "moe_token_image_model"):
        model = mixed_modality.token_image_model(moe=spec["model"].startswith("moe"))
        return model, mixed_modality.TokenImageCaptions(model), mixed_modality.collate
    model = getattr(helpers, spec["model"])()
    return model, helpers.tiny_data(model), None


SCENARIOS = {
    # global clipping across three meshes (pytorch#180346 is one clip over several meshes): a limit that clips
    "mixed_global_clip": scenario(MIXED, grad_clip_scope="global", max_grad_norm=0.05, save_strategy="steps",
                                  save_steps=1),
    "replicated_per_module_clip": scenario(REPLICATED),
    "hsdp_empty_init": scenario({"vision": {"trainable": False}, "projector": {"learning_rate": 3e-3},
                                 "llm": {**LLM, "parallelism": HSDP, "max_grad_norm": 0.5}}, model="empty_init_model"),
    # fsdp_scope: model wraps the composed model once, on the top-level parallelism's mesh
    "model_scope_hsdp": scenario({"vision": {"learning_rate": 1e-3}, "projector": {"learning_rate": 3e-3}},
                                 fsdp_scope="model", parallelism=HSDP),
    # accumulation windows per mesh against one process without accumulation: llm and projector (HSDP 2x2)
    # reduce-scatter every micro-step and all-reduce at the window's last (`sync_each_batch` unset), the projector's
    # units kept gathered inside the window; vision (full shard over 4) with `sync_each_batch: false` syncs nothing
    # until the last micro-step
    "hsdp_accumulation": {
        "multi": dict(COMMON, modules=dict(MIXED, projector={**MIXED["projector"], "fsdp_plugin": {
            "reshard_after_backward": False}}, vision={**MIXED["vision"], "sync_each_batch": False}),
            per_device_train_batch_size=1, gradient_accumulation_steps=2, ddp_timeout=1234),
        "single": dict(COMMON, modules=MIXED, per_device_train_batch_size=8),
        "model": "tiny_model", "atol": 1e-5},
    # some ranks have no image (mixed_modality.STEPS): vision trained sharded, its entry point runs a dummy there
    "missing_modality": scenario(MISSING, model="mixed_model"),
    # accumulation: no image anywhere in a window's last micro-step, after one in its first; the forward drops 0
    # rows and returns a tuple (vision and projector reached through hf_omni's hook)
    "missing_modality_accumulation": {
        "multi": dict(COMMON, modules=MISSING, per_device_train_batch_size=1, gradient_accumulation_steps=2,
                      ddp_timeout=1234),
        "single": dict(COMMON, modules=MISSING, per_device_train_batch_size=4, gradient_accumulation_steps=2),
        "model": "dropping_model", "atol": 1e-5},
    # the module without input split by tensor parallelism (a Llama reading image tokens at dp_shard 2 x tp 2): a rank
    # without an image runs the dummy inside its tp group, whose boundary gathers the group's rows (real and dummy)
    "missing_modality_tp": scenario({**MISSING, "vision": {"learning_rate": 1e-3, "parallel": "fsdp", "parallelism": {
        "dp_shard_size": 2, "tp_size": 2}}}, model="token_image_model"),
    # ... and by expert parallelism (a Qwen2-MoE reading image tokens, its 4 experts over ep 2): a rank without an
    # image still joins its experts' all-to-alls with the dummy's rows
    "missing_modality_ep": scenario({**MISSING, "vision": {"learning_rate": 1e-3, "parallel": "fsdp", "parallelism": {
        "dp_shard_size": 4, "ep_size": 2}}}, model="moe_token_image_model"),
    # ... and by sequence parallelism (the Llama image-token reader at dp_shard 2 x sp 2: 17 tokens padded to 18, 9 a
    # rank): a rank without an image exchanges the dummy's rows with its group
    "missing_modality_sp": scenario({**MISSING, "vision": {"learning_rate": 1e-3, "parallel": "fsdp", "parallelism": {
        "dp_shard_size": 2, "sp_size": 2}}}, model="token_image_model"),
    # the same from vision's offline cache: a rank without an image gets 0 rows shaped like the cached ones
    "missing_modality_offline": scenario({"vision": {"trainable": False}, "projector": {"learning_rate": 3e-3},
                                          "llm": {**LLM, "parallelism": HSDP}}, model="mixed_model",
                                         offline_modules=["vision"]),
}
