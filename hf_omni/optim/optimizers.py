"""One optimizer and one LR scheduler per trainable module, behind composites Trainer's loop can drive.

State dicts are keyed by module name (never by position), so a checkpoint names every piece of state.
"""

from __future__ import annotations

import copy

import torch
from torch import nn
from transformers import Trainer, TrainingArguments, get_scheduler
from transformers.training_args import OptimizerNames

from ..arguments.module import ModuleArguments
from ..compat import decay_parameter_names, scaler_state, scheduler_step_count, set_scheduler_step_count
from ..core.errors import OmniArgumentError
from .gradients import share_found_inf


def build_module_optimizer(module: nn.Module, margs: ModuleArguments, base_args: TrainingArguments):
    """The module's optimizer, built exactly as Trainer builds its own (decay / no-decay groups, `optim`,
    `optim_args`, Adam betas / eps from the top level), with the module's learning rate and weight decay."""
    args = copy.copy(base_args)
    args.learning_rate = margs.learning_rate
    args.weight_decay = margs.weight_decay
    args.optim = OptimizerNames(margs.optim)
    args.optim_args = margs.optim_args
    decay = decay_parameter_names(module)
    named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
    groups = [
        {"params": [p for n, p in named if n in decay], "weight_decay": margs.weight_decay},
        {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0},
    ]
    groups = [g for g in groups if g["params"]]
    optimizer_cls, optimizer_kwargs = Trainer.get_optimizer_cls_and_kwargs(args, module)
    for key in ("params", "model", "optimizer_dict"):
        if key in optimizer_kwargs:
            raise ValueError(f"modules.{margs.name}.optim: optimizer {margs.optim!r} builds its own parameter "
                             "groups, which per-module optimizers do not support")
    return optimizer_cls(groups, **optimizer_kwargs)


def build_module_scheduler(optimizer, margs: ModuleArguments, num_training_steps: int):
    return get_scheduler(
        margs.lr_scheduler_type,
        optimizer=optimizer,
        num_warmup_steps=margs.warmup_steps_for(num_training_steps),
        num_training_steps=num_training_steps,
        scheduler_specific_kwargs=dict(margs.lr_scheduler_kwargs or {}),
    )


def build_optimizers(model, base_args: TrainingArguments, num_training_steps: int | None, scaler=None):
    """One optimizer and one scheduler per trainable module (its slot's resolved arguments), behind the
    composites."""
    trained = [slot for slot in model.slots.values() if slot.trains]
    for slot in trained:  # each slot owns its optimizer and scheduler; the composites drive them
        slot.optimizer = build_module_optimizer(slot.module, slot.args, base_args)
        try:
            slot.scheduler = build_module_scheduler(slot.optimizer, slot.args, num_training_steps)
        except ValueError as err:
            raise OmniArgumentError(slot.name, "lr_scheduler_type",
                                    f"{err} (pass num_training_steps to prepare)") from None
    optimizer = ModuleOptimizers({s.name: s.optimizer for s in trained}, {s.name: s.module for s in trained}, scaler)
    return optimizer, ModuleSchedulers({s.name: s.scheduler for s in trained}, optimizer)


class ModuleOptimizers(torch.optim.Optimizer):
    """Steps every module's optimizer; `params[module]`: the parameters it trains, in module order (what clipping
    reads). Stateful by module name: `state_dict()` is `{module: its optimizer's state}` in DCP's form (keyed by
    parameter name, every rank its own shards of a sharded module), which a checkpoint writes as it is. With fp16
    (`scaler`: the Accelerator's one GradScaler, shared by every module): `unscale_()` each optimizer once before
    clipping; then every optimizer's found-inf is summed on the device and over every rank (one scalar all-reduce)
    and handed back to each; read once on the host, it decides for all: an inf / nan in any module's gradients on
    any rank skips every module's step. Then one `update()`.
    `stepped`: the modules whose optimizer stepped in the last `step()` (what the schedulers follow; DCP's state-dict
    helper steps a fresh optimizer with a zero learning rate, which is no step of training and is not counted).

    A `torch.optim.Optimizer` (its own constructor is not run: the modules' optimizers hold the parameters), so
    that `accelerator.prepare` wraps it as it wraps any optimizer and `accelerator.accumulate()` skips its `step` /
    `zero_grad` on the micro-steps that do not sync (not under fp16: Accelerate's scaler would unscale it first)."""

    def __init__(self, optimizers: dict[str, torch.optim.Optimizer], modules: dict[str, nn.Module], scaler=None):
        self.optimizers, self.modules = dict(optimizers), dict(modules)
        self.params = {name: [p for p in module.parameters() if p.requires_grad] for name, module in modules.items()}
        self.scaler = scaler if scaler is not None and scaler.is_enabled() else None
        self.unscaled = False
        self.before_step = None  # an async save in flight: wait until it copied the state this step changes
        self.stepped: set[str] | None = None  # the modules whose optimizer stepped in the last step(); None before
        self.after_step: list = []  # called after every step(), skipped or not (the profile counts steps)

    def unscale_(self) -> None:
        if self.scaler is not None and not self.unscaled:
            for opt in self.optimizers.values():
                self.scaler.unscale_(opt)
            self.unscaled = True

    @property
    def param_groups(self) -> list[dict]:
        return [group for opt in self.optimizers.values() for group in opt.param_groups]

    @property
    def defaults(self) -> dict:
        return next(iter(self.optimizers.values())).defaults

    @property
    def state(self) -> dict:
        """Every module's per-parameter state (a merged view)."""
        return {p: s for opt in self.optimizers.values() for p, s in opt.state.items()}

    def step(self, closure=None):
        if closure is not None:
            raise ValueError("ModuleOptimizers.step does not take a closure")
        if self.before_step is not None:
            self.before_step()
        if self.scaler is None:
            for opt in self.optimizers.values():
                opt.step()
            self.stepped = set(self.optimizers)
            return self._stepped()
        if scaler_state(self.scaler, self):  # `accelerator.prepare(optimizer)`: its scaler unscaled us already
            raise RuntimeError("fp16: step the plugin's optimizer itself, not the one accelerator.prepare returns: it "
                               "unscales and steps every module's optimizer through the one GradScaler (a second "
                               "unscale would divide the gradients by the scale twice)")
        self.unscale_()
        found_inf = share_found_inf(self.scaler, list(self.optimizers.values()))
        self.stepped = set()
        if not found_inf.item():  # fp16's one host read per step (torch's scaler.step reads once per optimizer)
            for opt in self.optimizers.values():
                opt.step()  # gradients unscaled already: fused optimizers step as they would outside fp16
            self.stepped = set(self.optimizers)
        self.scaler.update()  # every rank and optimizer handed the same found-inf: the scale moves alike
        self.unscaled = False
        self._stepped()

    def _stepped(self) -> None:
        for callback in self.after_step:
            callback()

    def zero_grad(self, set_to_none: bool = True):
        for opt in self.optimizers.values():
            opt.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict:
        """`{module: state}`; an optimizer that never stepped stays as it was (torch's state-dict helper steps it
        with a zero learning rate to make its state) and gives no state."""
        out = {}
        for name, opt in self.optimizers.items():
            fresh = not opt.state
            out[name] = self.templates([name])[name]
            if fresh:
                opt.state.clear()
                out[name]["state"] = {}
        return out

    def templates(self, names=None) -> dict:
        """`{module: state}` with every parameter's state made (a never-stepped optimizer is stepped with a zero
        learning rate): the tensors, shaped as this rank holds them, that a load fills."""
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        return {name: get_optimizer_state_dict(self.modules[name], self.optimizers[name])
                for name in names or self.optimizers}

    def load_state_dict(self, state_dict: dict) -> None:
        """`state_dict()`'s form; parameters with no state in it (never stepped when saved) get none."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        if set(state_dict) != set(self.optimizers):
            raise ValueError(f"optimizer state is for modules {sorted(state_dict)}, "
                             f"but the trainable modules are {sorted(self.optimizers)}")
        for name, opt in self.optimizers.items():
            module, state = self.modules[name], state_dict[name]
            params = {fqn: p for fqn, p in module.named_parameters() if p.requires_grad}
            stateless = [fqn for fqn in params if fqn not in state["state"]]
            set_optimizer_state_dict(module, opt, state, options=StateDictOptions(strict=not stateless))
            for fqn in stateless:  # as in the saved run: no state until their first gradient
                opt.state.pop(params[fqn], None)

    def __repr__(self) -> str:
        return f"ModuleOptimizers({', '.join(f'{n}: {type(o).__name__}' for n, o in self.optimizers.items())})"


class ModuleSchedulers(torch.optim.lr_scheduler.LRScheduler):
    """Steps every module's scheduler; `get_last_lr()` lists the modules' rates in module order. An `LRScheduler`
    (its constructor not run) so that `accelerator.prepare` wraps it like any scheduler."""

    def __init__(self, schedulers: dict[str, torch.optim.lr_scheduler.LRScheduler],
                 optimizer: ModuleOptimizers | None = None):
        self.schedulers = dict(schedulers)
        self.optimizer = optimizer  # its `stepped`: a module whose step was skipped (fp16 overflow) keeps its rate
        self.stepped_lr: dict[str, float] = {}  # the rates the last optimizer step used
        set_scheduler_step_count(self, 1)  # as torch's constructor leaves it (Accelerate counts skipped micro-steps)

    def step(self, epoch=None):
        if epoch is not None:
            raise ValueError("ModuleSchedulers.step does not take an epoch")
        stepped = self.optimizer.stepped if self.optimizer is not None else None
        self.stepped_lr = self.last_lr_by_module()
        for name, sched in self.schedulers.items():
            if stepped is None or name in stepped:
                sched.step()
        set_scheduler_step_count(self, scheduler_step_count(self) + 1)

    def get_lr(self) -> list[float]:
        return self.get_last_lr()

    def get_last_lr(self) -> list[float]:
        return [lr for sched in self.schedulers.values() for lr in sched.get_last_lr()]

    def last_lr_by_module(self) -> dict[str, float]:
        return {name: float(sched.get_last_lr()[0]) for name, sched in self.schedulers.items()}

    def state_dict(self) -> dict:
        return {name: sched.state_dict() for name, sched in self.schedulers.items()}

    def load_state_dict(self, state_dict: dict) -> None:
        if set(state_dict) != set(self.schedulers):
            raise ValueError(f"scheduler state is for modules {sorted(state_dict)}, "
                             f"but the trainable modules are {sorted(self.schedulers)}")
        for name, sched in self.schedulers.items():
            sched.load_state_dict(state_dict[name])
