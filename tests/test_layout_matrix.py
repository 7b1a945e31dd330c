"""docs/parallel.md's layout x feature matrix: every cell of every layout hf_omni ships is served by a named test
scenario that exists, or declared by the layout (refused by name, or not applying); and the page holds the table."""

import os

import layout_matrix
import pytest

from hf_omni.parallel.layout import FEATURES, LAYOUTS

TESTS = os.path.dirname(os.path.abspath(__file__))


@pytest.mark.parametrize("layout", [cls.name for cls in LAYOUTS.own()])
def test_every_cell_is_tested_or_declared(layout):
    cls = LAYOUTS[layout]
    known = layout_matrix.scenarios()
    for feature in FEATURES:
        tested = layout_matrix.TESTED.get(layout, {}).get(feature)
        note = cls.notes.get(feature)
        assert (tested is None) != (note is None), f"{layout} x {feature}: one test or one note, got {tested}, {note}"
        if tested is not None:
            assert os.path.isfile(os.path.join(TESTS, tested[0])), tested
            assert tested[1] in known, f"{layout} x {feature}: no scenario {tested[1]!r}"
        else:
            assert note.startswith(("refused: ", "n/a: ")), note
    assert set(cls.notes) <= set(FEATURES)
    assert set(layout_matrix.TESTED.get(layout, {})) <= set(FEATURES)


def test_the_page_holds_the_matrix():
    with open(os.path.join(os.path.dirname(TESTS), "docs", "parallel.md")) as f:
        page = f.read()
    assert "\n".join(layout_matrix.rows()) in page


@pytest.mark.parametrize("layout", [cls.name for cls in LAYOUTS.own() if "diffusers denoiser" in cls.notes])
def test_a_diffusers_denoiser_is_refused_by_name(layout):
    """The cells declared refused are refused: a Flux transformer (no transformers plan) under the layout."""
    from tiny_pipelines import flux_pipeline

    from hf_omni.core.errors import OmniArgumentError
    from hf_omni.parallel.layout import layouts_for

    cls = LAYOUTS[layout]
    assert cls.notes["diffusers denoiser"].startswith("refused: ")
    entry = {"dp_shard_size": 2, cls.size_key: 2}
    with pytest.raises(OmniArgumentError, match=rf"transformer.*parallelism\.{cls.size_key}.*FluxTransformer2DModel"
                                                r"( has no (tensor|expert)-parallel plan|'s attention is not reached)"):
        layouts_for("transformer", entry)[0].check(flux_pipeline().transformer)
