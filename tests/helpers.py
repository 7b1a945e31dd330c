"""Shared test helpers: a tiny composed model, its data, arguments and a hand-written reference loop."""

from __future__ import annotations

import copy
import os

import torch
from transformers import get_scheduler

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

from hf_omni import OmniTrainingArguments, register_module_class
from hf_omni.testing.digits import Captioner, build_model, load_splits


def tiny_model(seed: int = 0, vision_dropout: float = 0.0) -> Captioner:
    return build_model(hidden=32, layers=1, llm_hidden=32, llm_layers=1, seed=seed, vision_dropout=vision_dropout)


def tiny_data(model, n: int = 64):
    train, _ = load_splits(model.processors["llm"])
    return torch.utils.data.Subset(train, range(n))


def make_args(output_dir, **overrides) -> OmniTrainingArguments:
    base = dict(output_dir=str(output_dir), use_cpu=True, report_to="none", save_strategy="no", disable_tqdm=True,
                logging_steps=1, train_sampling_strategy="sequential", optim="adamw_torch", seed=0,
                dataloader_drop_last=True, per_device_train_batch_size=8, max_steps=4)
    base.update(overrides)
    return OmniTrainingArguments(**base)


def step_losses(trainer) -> list[float]:
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


def batches(dataset, batch_size: int):
    for start in range(0, len(dataset) - batch_size + 1, batch_size):
        items = [dataset[i] for i in range(start, start + batch_size)]
        yield {key: torch.stack([item[key] for item in items]) for key in items[0]}


def reference_train(model, dataset, steps: int, batch_size: int, settings: dict, clip_scope: str = "per_module",
                    global_max_norm: float = 1.0, autocast: torch.dtype | None = None):
    """Plain PyTorch: one AdamW + scheduler per trainable module, clipping per module or global; `autocast`: the
    forward under CPU autocast in that dtype.

    settings: {module: {"lr", "weight_decay", "scheduler", "warmup", "max_norm"}} for trainable modules; any other
    module is frozen (eval mode, no grad). Decay groups: tensors of 2+ dims decay, the rest do not."""
    optimizers, schedulers = {}, {}
    for name, module in model.omni_modules().items():
        if name not in settings:
            module.requires_grad_(False)
            continue
        s = settings[name]
        params = [p for p in module.parameters() if p.requires_grad]
        groups = [{"params": [p for p in params if p.ndim >= 2], "weight_decay": s.get("weight_decay", 0.0)},
                  {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]
        optimizers[name] = torch.optim.AdamW([g for g in groups if g["params"]], lr=s["lr"])
        schedulers[name] = get_scheduler(s.get("scheduler", "linear"), optimizers[name],
                                         num_warmup_steps=s.get("warmup", 0), num_training_steps=steps)
    model.train()
    for name, module in model.omni_modules().items():
        if name not in settings:
            module.eval()
    losses = []
    for _, batch in zip(range(steps), batches(dataset, batch_size)):
        with torch.autocast("cpu", dtype=autocast, enabled=autocast is not None):
            loss = model(**batch).loss.float()
        loss.backward()
        losses.append(loss.item())
        grads = {n: [p for p in getattr(model, n).parameters() if p.grad is not None] for n in optimizers}
        if clip_scope == "global":
            torch.nn.utils.clip_grad_norm_([p for ps in grads.values() for p in ps], global_max_norm)
        else:
            for name, params in grads.items():
                if settings[name].get("max_norm"):
                    torch.nn.utils.clip_grad_norm_(params, settings[name]["max_norm"])
        for name in optimizers:
            optimizers[name].step()
            schedulers[name].step()
            optimizers[name].zero_grad()
    return losses


def full_state(model) -> dict[str, torch.Tensor]:
    """Every parameter and buffer in full (sharded DTensors gathered; every rank calls it), on CPU; none of an
    offline module's (on the meta device)."""
    out = {}
    for key, value in model.state_dict().items():
        if value.is_meta:
            continue
        if hasattr(value, "full_tensor"):
            value = value.full_tensor()
        out[key] = value.detach().cpu().clone()
    return out


def scenario(modules, multi: dict, single: dict, common: dict, model: str = "tiny_model", atol: float = 1e-6,
             **extra) -> dict:
    """A run at several ranks ("multi") and at one ("single", the same global batch) of a multi-rank test; "model": a
    builder's name, "atol": the tolerance of the comparison."""
    return {"multi": dict(common, modules=modules, **multi, **extra),
            "single": dict(common, modules=modules, **single, **extra), "model": model, "atol": atol}


def clone(model):
    return copy.deepcopy(model)


def assert_state_close(a: dict, b: dict, atol: float):
    assert a.keys() == b.keys()
    for key in a:
        diff = (a[key].float() - b[key].float()).abs().max().item()
        assert diff <= atol, f"{key}: max |diff| {diff} > {atol}"


@register_module_class
class VisionTower(__import__("transformers").ViTModel):
    """A ViT with the `get_image_features` method VLM towers have (called instead of `forward`)."""

    def get_image_features(self, pixel_values):
        return self(pixel_values=pixel_values).last_hidden_state


class FeatureCaptioner(Captioner):
    """Calls two module methods that are not the module's own forward: get_image_features, get_input_embeddings."""

    def forward(self, pixel_values, input_ids, labels=None, **kw):
        prefix = self.projector(self.vision.get_image_features(pixel_values))
        embeds = torch.cat([prefix, self.llm.get_input_embeddings()(input_ids)], dim=1)
        if labels is not None:
            labels = torch.cat([labels.new_full(prefix.shape[:2], -100), labels], dim=1)
        return self.llm(inputs_embeds=embeds, labels=labels, **kw)


def tiny_feature_model(seed: int = 0) -> FeatureCaptioner:
    base = tiny_model(seed)
    tower = VisionTower(base.vision.config, add_pooling_layer=False)
    tower.load_state_dict(base.vision.state_dict())
    modules = {**base.omni_modules(), "vision": tower}
    return FeatureCaptioner.from_modules(modules, processors=base.processors)


def empty_init_model():
    """tiny_model() saved once (rank 0 under a process group), then rebuilt with empty_init=True: modules on
    the meta device until OmniPlugin.prepare fills them."""
    import tempfile

    import torch.distributed as dist

    folder = os.environ.get("HF_OMNI_TEST_SAVED") or tempfile.mkdtemp()
    distributed = dist.is_available() and dist.is_initialized()
    if not distributed or dist.get_rank() == 0:
        tiny_model().save_pretrained(folder)
    if distributed:
        dist.barrier()
    model = Captioner.from_pretrained(folder, empty_init=True)
    assert all(p.is_meta for p in model.parameters())
    return model


def save_every_rank(results, path: str, save=None) -> None:
    """In a launched script: every rank's `results` gathered, written by rank 0 to `path` (`torch.save`, or
    `save(everyone, path)`), then every rank waits for the file."""
    import torch.distributed as dist

    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, results)
    if dist.get_rank() == 0:
        (save or torch.save)(everyone, path)
    dist.barrier()


def count_metadata_reads(monkeypatch, root) -> dict:
    """Every reading of a `state/`'s DCP metadata (all its shard headers, torch's `HuggingFaceStorageReader.
    read_metadata`, which hf_omni's `ShardReader` calls on rank 0 before broadcasting) from now on, by folder
    relative to `root`: the returned dict fills as they happen."""
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    reads, read = {}, HuggingFaceStorageReader.read_metadata

    def counted(self):
        folder = os.path.relpath(str(self.path), str(root))
        reads[folder] = reads.get(folder, 0) + 1
        return read(self)

    monkeypatch.setattr(HuggingFaceStorageReader, "read_metadata", counted)
    return reads
