"""A module's input embeddings, as the strategies and the composed model ask for them: a module's own
(`embeddings_of`: FSDP2 makes them a unit of their own, tensor parallelism a boundary), and the composed model's
(`model_input_embeddings`: the one NEFTune adds its noise to)."""

from __future__ import annotations

from torch import nn


def embeddings_of(module: nn.Module):
    """A module's input embeddings, or None where it defines none (transformers raises for such a class)."""
    getter = getattr(module, "get_input_embeddings", None)
    if getter is None:
        return None
    try:
        return getter()
    except NotImplementedError:  # transformers' answer for a class without them
        return None


def embedding_tables(module: nn.Module) -> list[nn.Module]:
    """Every input-embedding table of a module that FSDP2 makes a unit of its own (a model's forward may look
    tokens up before the module's own forward runs): the module's own, or each root's for a module of several
    released submodules, a list of tables as each of its tables (Qwen3-Omni's talker: its codec embeddings, and
    its code predictor's, one per codebook)."""
    from .units import run_roots

    found = []
    for owner in run_roots(module):
        try:
            table = embeddings_of(owner)
        except AttributeError:  # a released submodule whose class's getter reaches for what it lacks
            table = None
        for one in table.children() if isinstance(table, (nn.ModuleList, nn.ModuleDict)) else [table]:
            if one is not None and all(one is not f for f in found):
                found.append(one)
    return found


def is_token_embedding(module) -> bool:
    """An `nn.Embedding`, or a PEFT layer around one (LoRA on the embeddings)."""
    return isinstance(module, nn.Embedding) or isinstance(getattr(module, "base_layer", None), nn.Embedding)


def model_input_embeddings(model) -> nn.Module:
    """`OmniModel.get_input_embeddings`: the token embeddings of the module named by the class attribute
    `input_embeddings_module`, or of the one module that has token embeddings (what Trainer's NEFTune adds its
    noise to)."""
    name = model.input_embeddings_module
    if name is None:
        found = [n for n, m in model.omni_modules().items() if is_token_embedding(embeddings_of(m))]
        if len(found) != 1:
            raise ValueError(f"{type(model).__name__}: {len(found)} modules have token embeddings {found}: name "
                             f"the one that is the model's with the class attribute input_embeddings_module = "
                             f"'<module>' (NEFTune's noise goes there)")
        name = found[0]
    if name not in model.module_names:
        raise ValueError(f"{type(model).__name__}.input_embeddings_module: {name!r} is not a module "
                         f"{model.module_names}")
    return getattr(model, name).get_input_embeddings()
