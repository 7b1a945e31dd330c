"""A toy composition, the recipe of docs/how_it_works.md "Add a composition": a composed model that keeps a recipe
beside its modules (the token ids its forward prepends to every row), recorded in the root config and written as
`recipe.json` beside the module folders of every save, checkpoint and export, loaded back by `from_pretrained`. One
file plus one `register_composition`: a plain composition (`compositions/plain.py`) that answers what differs."""

from __future__ import annotations

import json
import os
import shutil

from hf_omni import register_composition
from hf_omni.compositions.plain import PlainComposition

RECIPE = "recipe.json"


@register_composition
class RecipeComposition(PlainComposition):
    name = "recipe"
    description = "named modules and a recipe beside them (a test of the composition extension point)"
    catch_all = False

    def holds(self, config) -> bool:
        return getattr(config, "recipe", None) is not None

    def compose(self, cls, modules: dict, processors=None, sources=None, *, recipe: dict):
        model = super().compose(cls, modules, processors, sources)
        model.config.recipe = {"file": RECIPE}  # the root config records the kind
        model.recipe = dict(recipe)
        return model

    def config_record(self, model) -> dict:
        return {"recipe": model.config.recipe}

    def write_root(self, model, directory: str) -> None:
        super().write_root(model, directory)
        with open(os.path.join(directory, RECIPE), "w") as f:
            json.dump(model.recipe, f)

    def load_beside(self, model, root: str) -> None:
        with open(os.path.join(root, RECIPE)) as f:
            model.recipe = json.load(f)

    def owns_saved(self, root: str) -> bool:
        return os.path.isfile(os.path.join(root, RECIPE))

    def beside_patterns(self, config) -> list[str]:
        return [RECIPE]

    def export_checkpoint(self, checkpoint: str, config, out: str) -> None:
        super().export_checkpoint(checkpoint, config, out)
        shutil.copy2(os.path.join(checkpoint, RECIPE), os.path.join(out, RECIPE))
