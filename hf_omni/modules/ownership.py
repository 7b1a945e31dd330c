"""Every parameter and buffer of a composed model belongs to exactly one of its modules: checkpoints and exports
have one folder per module (none for the composed model), and each module has its own optimizer."""

from __future__ import annotations


def check_ownership(model) -> None:
    """Refuse, naming them, tensors the composed model owns outside every module and tensors reachable from two
    modules (stepped by two optimizers, saved twice, sharded twice)."""
    owned = [n for n, _ in list(model.named_parameters()) + list(model.named_buffers())
             if n.split(".", 1)[0] not in model.module_names]
    if owned:
        raise ValueError(f"{type(model).__name__} owns tensors outside every module: {owned[:5]}. Checkpoints and "
                         "exports have one folder per module and none for the composed model: put them in a module "
                         "(a Projector, or a small PreTrainedModel) passed to from_modules")
    seen: dict[int, tuple[str, str]] = {}
    for name in model.module_names:
        module = getattr(model, name)
        for tensor_name, tensor in list(module.named_parameters(remove_duplicate=False)) + list(
                module.named_buffers(remove_duplicate=False)):
            owner = seen.setdefault(id(tensor), (name, tensor_name))
            if owner[0] != name:
                raise ValueError(
                    f"modules {owner[0]!r} and {name!r} share a tensor ({owner[1]} of {owner[0]!r}, {tensor_name} of "
                    f"{name!r}): two optimizers would step it and two checkpoints hold it. A tensor belongs to one "
                    "module: keep it in one and call that module from the other in forward (e.g. "
                    f"self.{name}.get_input_embeddings()(ids))")
