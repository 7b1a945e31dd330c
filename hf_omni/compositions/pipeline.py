"""The pipeline composition (`OmniModel.from_pipeline`): a diffusers pipeline adopted as downloaded, every
`nn.Module` component a module (`diffusion.pipeline`), saved as a pipeline folder `PipelineClass.from_pretrained`
loads.

    out/model_index.json       written last: it makes the folder a pipeline folder
    out/config.json            the root config, with the pipeline's `model_index.json` values (`pipeline`)
    out/<component>/           each module in its library's format (LoRA merged); each part (scheduler, tokenizers)
    out/pytorch_lora_weights.safetensors    the LoRA, for `pipeline.load_lora_weights(out)` on the base
    <checkpoint>/PIPELINE.md   in place of model_index.json: a checkpoint is no pipeline folder (`hf-omni export`)
"""

from __future__ import annotations

import os

from ..core.errors import OmniArgumentError
from ..diffusion.hub_push import check_pipeline_layout, push_pipeline
from ..diffusion.index import INDEX, part_names
from ..diffusion.pipeline import from_pipeline, load_parts, to_pipeline, write_adapters, write_index, write_parts
from ..files.composition import register_composition
from .plain import PlainComposition, model_from


@register_composition
class PipelineComposition(PlainComposition):
    name = "pipeline"
    description = "a diffusers pipeline adopted as downloaded (`from_pipeline`), saved as a pipeline folder"
    catch_all = False

    def holds(self, config) -> bool:
        return bool(getattr(config, "pipeline", None))

    def owns_saved(self, root: str) -> bool:
        """A pipeline folder (`model_index.json` at its root: an export, never a checkpoint)."""
        return os.path.isfile(os.path.join(root, INDEX))

    def compose(self, cls, pipeline, path=None, **kwargs):
        return from_pipeline(cls, pipeline, path, **kwargs)

    def live(self, model):
        """A live diffusers pipeline over the modules as they are (`OmniModel.to_pipeline`)."""
        return to_pipeline(model)

    def config_record(self, model) -> dict:
        return {"pipeline": model.config.pipeline}

    def save(self, model, directory: str, *, is_main_process: bool, merge_lora: bool, max_shard_size,
             **kwargs) -> None:
        """Components merged (a pipeline folder holds no adapters), the LoRA also in diffusers' own file, the parts,
        then `model_index.json` last."""
        if is_main_process:
            os.makedirs(directory, exist_ok=True)
        self.write_modules(model, directory, True, is_main_process, max_shard_size)
        write_adapters(model, directory, is_main_process)  # every rank: a sharded adapter is gathered
        if is_main_process:
            self.write_root(model, directory)
            write_index(model, directory)

    def write_root(self, model, directory: str) -> None:
        super().write_root(model, directory)
        write_parts(model, directory)

    def load_beside(self, model, root: str) -> None:
        load_parts(model, root)

    def beside_patterns(self, config) -> list[str]:
        return [f"{n}/*" for n in part_names(config)] + [INDEX]

    def check_push(self, args, model) -> None:
        if not args.push_to_hub:  # one repo, diffusers' layout
            return
        check_pipeline_layout(args.hub_layout)
        strategy = str(getattr(args.hub_strategy, "value", args.hub_strategy))
        if strategy != "end":
            raise OmniArgumentError(None, "hub_strategy", f"{strategy!r}: a diffusers pipeline is pushed as its "
                                    "pipeline folder (save_model / push_to_hub()); its checkpoints hold LoRA adapters "
                                    "apart and frozen components elsewhere, which diffusers would load wrong: set "
                                    "hub_strategy: end")

    def push(self, root: str, repo_id: str, *, layout=None, token=None, private=None, revision=None,
             commit_message: str = "Upload with hf_omni", extra_folders=None, cards: bool = True,
             **kwargs) -> dict[str, str]:
        return push_pipeline(root, repo_id, layout=layout, token=token, private=private, revision=revision,
                             commit_message=commit_message, extra_folders=extra_folders, cards=cards)

    def export_checkpoint(self, checkpoint: str, config, out: str) -> None:
        """Loaded whole and saved: components merged, the LoRA in diffusers' file, `export_ema` EMA weights."""
        model_from(checkpoint, config).save_pretrained(out)
