"""The plugin's optimizer and scheduler in a diffusers-style Accelerate loop: `accelerator.prepare` wraps them like
torch's own, so `accelerator.accumulate()` skips their step on the micro-steps that do not sync."""

import torch
from custom_loops import accumulate_loop


def test_prepared_composites_equal_one_prepared_optimizer_and_scheduler_per_module(tmp_path):
    """At gradient_accumulation_steps=4: bitwise the loop that prepares each module's own torch optimizer and
    scheduler (Accelerate's scheduler stepping included). Unprepared, the composite scheduler stepped on every
    micro-step: 12 steps instead of 3."""
    composite, composite_lrs = accumulate_loop(True, str(tmp_path / "composite"))
    plain, plain_lrs = accumulate_loop(False, str(tmp_path / "plain"))
    assert composite_lrs == plain_lrs
    assert [k for k in plain if not torch.equal(composite[k], plain[k])] == []
    untrained, _ = accumulate_loop(False, str(tmp_path / "none"), steps=0)
    assert not torch.equal(plain["llm.lm_head.weight"], untrained["llm.lm_head.weight"])
