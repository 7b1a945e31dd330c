"""The refusals of a run's resolved module settings against its model, all before any compute: each names the
module and key (`OmniArgumentError`)."""

from __future__ import annotations

from ..diffusion.lora_file import check_lora_components
from ..dist import has_process_group
from ..errors import OmniArgumentError
from ..modules.folder import check_peft_merge
from ..offline.encoder import check_offline_modules
from ..tuning.checkpointing import check_checkpointed_modules


def check_before_compute(model, module_args: dict, args) -> None:
    """`module_args`: module -> its resolved `ModuleArguments`; `args`: the run's `OmniTrainingArguments`."""
    if has_process_group() and args.fsdp_scope == "module":
        for name, margs in module_args.items():
            if margs.trainable and margs.parallel == "none":
                raise OmniArgumentError(name, "parallel", "`none` under a process group trains one copy per rank: "
                                        "the replicas would diverge and a checkpoint keeps one of them. Use `ddp` or "
                                        "`fsdp`, or `trainable: false`")
    for name, margs in module_args.items():
        if margs.trainable and margs.export_ema and margs.ema is None:
            raise OmniArgumentError(name, "export_ema", "exports the EMA weights: set `ema` too")
    if not any(m.trainable for m in module_args.values()):
        raise OmniArgumentError(None, "modules", "nothing is trainable: every module has trainable: false")
    check_checkpointed_modules(model, module_args)
    check_lora_components(model, {n: m.lora for n, m in module_args.items() if m.trainable and m.lora_from_module})
    check_offline_modules(model, list(args.offline_modules or []))


def check_ignored_modules(model, args) -> None:
    """After freezing and LoRA, before any wrap or compute: FSDP leaves `fsdp_plugin.ignored_modules` unsharded and
    never reduces their gradients, so a submodule there with a parameter that trains would be stepped by each rank
    on its own gradient (the replicas diverge) and crash the first clip (plain tensors beside DTensors): refused,
    naming the module (none under `fsdp_scope: model`, whose one plugin is the top level's), the key and the
    parameters. Frozen submodules (a frozen tower's, a LoRA base's) may be ignored."""
    if args.fsdp_scope == "model":
        ignored = args.fsdp_plugin.get("ignored_modules") if isinstance(args.fsdp_plugin, dict) else None
        refuse_trained(None, model, ignored)
        return
    for name, slot in model.slots.items():
        if slot.args is not None and slot.args.parallel == "fsdp":
            refuse_trained(name, slot.module, getattr(slot.settings, "ignored_modules", None))


def refuse_trained(name: str | None, module, ignored) -> None:
    from ..compat import fsdp_ignored_params

    if ignored is None:
        return
    params = fsdp_ignored_params(ignored, module, None)
    trained = [n for n, p in module.named_parameters() if p.requires_grad and p in params]
    if trained:
        shown = f"'{ignored}'" if isinstance(ignored, str) else repr(ignored)
        raise OmniArgumentError(name, "fsdp_plugin.ignored_modules", f"{shown} holds parameters that train "
                                f"({', '.join(trained[:3])}{', ...' if len(trained) > 3 else ''}): FSDP never "
                                "reduces an ignored module's gradients, so each rank would step its own copy. "
                                "Freeze those submodules, or leave them out of ignored_modules")


def check_after_tuning(model, args) -> None:
    """After freezing and LoRA, before any wrap or compute: trained submodules among FSDP's `ignored_modules`, and
    with `merge_lora_on_export` a LoRA merge the export could not do, refused now instead of after training."""
    check_ignored_modules(model, args)
    for slot in model.slots.values() if args.merge_lora_on_export else ():
        check_peft_merge(slot.module, slot.name)
