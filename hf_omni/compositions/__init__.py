"""Compositions, the kinds of composed model (`files.composition.Composition`), one file each: a plain composition
(`plain`: `OmniModel.from_modules`), an adopted released model (`adopted`: `from_model`) and a diffusers pipeline
(`pipeline`: `from_pipeline`). Importing the package registers them all."""

from . import adopted, pipeline, plain  # noqa: F401 (each registers its composition)
