"""An adopted model's encoder method (`get_image_features`) served from the offline cache.

    offline_modules: [vision]
    modules:
      vision: {trainable: false, offline_encoder: get_image_features}

The method's outputs, per image as transformers returns them (`pooler_output`: a tuple of per-image tensors of
different lengths for Qwen2.5-VL), are cached like any `@offline_encoder`'s (`offline.ragged`), and the released
`forward` takes them back through its own `mm_encoder_outputs` argument instead of `pixel_values`. Both LLaVA's and
Qwen2.5-VL's `get_image_features` run the projector too: caching them means the projector is frozen and cached
with the tower, so the module must hold both (`modules={"vision": ["model.vision_tower",
"model.multi_modal_projector"], ...}`). Any other module the method runs is refused while encoding, before any
output is written, naming the module. An omni model's method is its thinker's (`thinker.get_image_features`): the
training step hands the cached outputs to the thinker the same way.
"""

from __future__ import annotations

import inspect

from ..core.errors import OmniArgumentError
from ..offline.spec import OfflineEncoder

METHODS = {"get_image_features": "image", "get_video_features": "video"}  # method -> its `mm_encoder_outputs` key
INPUTS = {"image": ("pixel_values", "image_grid_thw"), "video": ("pixel_values_videos", "video_grid_thw")}
GRIDS = ("image_grid_thw", "video_grid_thw")  # count a row's items, and the forward reads them too (M-RoPE)


def leaf(method: str) -> str:
    """`thinker.get_image_features` -> `get_image_features`."""
    return method.rpartition(".")[2]


def released_method(released, method: str):
    """The released model's method, or its submodule's for a dotted name (an omni model's thinker's), or None."""
    holder, _, name = method.rpartition(".")
    try:
        owner = released.get_submodule(holder) if holder else released
    except AttributeError:
        return None
    return getattr(owner, name, None)


def released_specs(model) -> dict[str, OfflineEncoder]:
    """Module -> the encoder its `offline_encoder` setting names (a spec like an `@offline_encoder`'s)."""
    specs = {}
    for name, slot in model.slots.items():
        method = getattr(slot.args, "offline_encoder", None)
        if method is None:
            continue
        if leaf(method) not in METHODS:
            raise OmniArgumentError(name, "offline_encoder", f"{method!r} is not one of {sorted(METHODS)} (or such "
                                    "a method of a submodule: 'thinker.get_image_features')")
        function = released_method(model.released, method)
        if not callable(function):
            raise OmniArgumentError(name, "offline_encoder", f"{type(model.released).__name__} has no {method}")
        modality = METHODS[leaf(method)]
        taken = inspect.signature(function).parameters
        inputs = tuple(c for c in INPUTS[modality] if c in taken)
        items = next((c for c in inputs if c in GRIDS), None)
        specs[name] = OfflineEncoder(name, inputs, f"{modality}_features", method, "tuple", items,
                                     keeps=(items,) if items else ())
    return specs


def released_encoder(model, spec: OfflineEncoder):
    """`spec.method` of the released model, its per-item outputs; refused if it runs a module that is not cached."""
    others = {slot.name: slot for slot in model.slots.values() if slot.encoder is None}

    def encode(**inputs):
        ran: list[str] = []
        hooks = [root.module.register_forward_hook(lambda *_, name=name, path=root.path: ran.append(f"{name}: {path}"))
                 for name, slot in others.items() for root in slot.module.omni_roots]
        try:
            out = released_method(model.released, spec.method)(**inputs, return_dict=True)
        finally:
            for hook in hooks:
                hook.remove()
        if ran:
            raise OmniArgumentError(spec.module, "offline_encoder", f"{spec.method} also runs {sorted(set(ran))}: "
                                    "an adopted model's entry point can be cached only when everything it runs is "
                                    "frozen and cached with it (LLaVA's and Qwen2.5-VL's include the projector: "
                                    "caching them means a frozen projector too). Put those paths in this module "
                                    "(trainable: false), or serve the module online")
        return tuple(out.pooler_output)

    return encode


def served_signature(signature: inspect.Signature) -> inspect.Signature:
    """The released forward's signature plus the cached-output columns (keyword-only), so that Trainer's column
    removal keeps them."""
    params = list(signature.parameters.values())
    at = next((i for i, p in enumerate(params) if p.kind is p.VAR_KEYWORD), len(params))
    extra = [inspect.Parameter(f"{m}_features", inspect.Parameter.KEYWORD_ONLY, default=None)
             for m in METHODS.values() if f"{m}_features" not in signature.parameters]
    return signature.replace(parameters=params[:at] + extra + params[at:])


def served_outputs(model, kwargs: dict) -> dict:
    """The cached outputs in a batch, taken out of `kwargs` as the released forward's `mm_encoder_outputs`."""
    from transformers.modeling_outputs import BaseModelOutputWithPooling

    found = {}
    for slot in model.slots.values():
        spec = slot.encoder
        if spec is not None and leaf(spec.method) in METHODS and spec.output in kwargs:
            found[METHODS[leaf(spec.method)]] = BaseModelOutputWithPooling(pooler_output=kwargs.pop(spec.output))
    return found
