"""The refusals of a run's resolved module settings against its model, all before any compute: each names the
module and key (`OmniArgumentError`)."""

from __future__ import annotations

from ..diffusion.lora_file import check_lora_components
from ..dist import has_process_group
from ..errors import OmniArgumentError
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
