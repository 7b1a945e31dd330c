"""The entry point of a module on a rank whose batch has no input for it (hf_omni/missing_modality.py), in one
process with the cross-rank exchange stubbed: the dummy's 0 rows, BatchNorm statistics untouched, the module's
backward reached through the loss even when `forward` drops the rows, and the errors. The 4-rank runs against one
process are in tests/test_mesh_multiprocess.py."""

import copy
import re

import pytest
import torch
from torch.utils.checkpoint import checkpoint
from transformers import ResNetConfig, ResNetModel

import hf_omni.offline.exchange as exchange_module
import hf_omni.offline.missing_modality as missing
from hf_omni import OmniModel, offline_encoder
from hf_omni.modules.slot import Stage
from hf_omni.offline import forward_plan
from hf_omni.offline.exchange import Shared
from hf_omni.parallel.ddp import DdpStrategy
from hf_omni.parallel.driver import Prepared


class Tower(OmniModel):
    checkpointed = False  # the vision call under activation checkpointing (recomputed in backward)

    @offline_encoder(module="vision", inputs=["pixel_values", "mask"], output="features")
    def encode(self, pixel_values, mask):
        def vision(pixels):
            return self.vision(pixel_values=pixels).pooler_output.flatten(1)

        pixels = pixel_values * mask
        return checkpoint(vision, pixels, use_reentrant=False) if self.checkpointed else vision(pixels)

    def forward(self, pixel_values=None, mask=None, labels=None):
        feats = self.encode(pixel_values, mask=mask)
        if feats is None or not len(feats):  # drops the 0 rows: hf_omni still joins them to the loss
            return {"loss": torch.zeros((), requires_grad=True)}
        return {"loss": feats.square().mean()}


@pytest.fixture
def tower():
    torch.manual_seed(0)
    vision = ResNetModel(ResNetConfig(num_channels=1, embedding_size=8, hidden_sizes=[16], depths=[1],
                                      layer_type="basic"))
    return Tower.from_modules({"vision": vision}).train()


SHAPES = {"pixel_values": ((3, 1, 4, 4), torch.float32), "mask": ((3, 1, 1, 1), torch.bool)}  # 4x4: BatchNorm
ROW = {"pixel_values": torch.rand(1, 1, 4, 4), "mask": torch.ones(1, 1, 1, 1, dtype=torch.bool)}  # sees 1x1 maps
SHAPES |= {"sound": SHAPES["pixel_values"], "sound_mask": SHAPES["mask"]}  # PlannedTowers' audio entry point
ROW |= {"sound": ROW["pixel_values"], "sound_mask": ROW["mask"]}


@pytest.fixture
def distributed(tower, monkeypatch):
    return stub_exchange(tower, monkeypatch)


def stub_exchange(model, monkeypatch) -> dict:
    """As if `model` were prepared over 2 ranks with its modules replicated; `exchange["others"]`: whether the other
    rank has images (3, whose row 0 is ROW)."""
    exchange = {"others": True, "calls": 0}
    model.prepared = Prepared()
    for slot in model.slots.values():
        slot.trains = True
        slot.wrapped(DdpStrategy({}))
    monkeypatch.setattr(forward_plan, "world_size", lambda: 2)

    def share_inputs(groups, problem=None):
        if problem is not None:  # as every rank would, once the exchange carried it
            raise ValueError(f"{problem} (on rank 0; every rank raises this)")
        shared = {}
        for key, values in groups.items():
            mine = all(v is not None and len(v) for v in values.values())
            donors = {c: SHAPES[c] for c in values} if exchange["others"] or mine else dict.fromkeys(values)
            donor = (0 if mine else 1) if exchange["others"] or mine else None
            shared[key] = Shared(donors, donor, mine and exchange["others"], mine)
        exchange["calls"] += 1
        return shared

    def agree(problem=None):  # a planned call's agreement: every rank went as planned, or all raise
        if problem is not None:
            raise ValueError(f"{problem} (on rank 0; every rank raises this)")

    monkeypatch.setattr(exchange_module, "share_inputs", share_inputs)
    monkeypatch.setattr(exchange_module, "agree", agree)
    monkeypatch.setattr(exchange_module, "broadcast_row", lambda donors, rank, inputs, prepared: None if rank is None
                        else {c: (inputs[c][:1] if rank == 0 else ROW[c]) for c in inputs})
    return exchange


def test_a_rank_without_input_gets_0_rows_and_reaches_the_module_backward(tower, distributed):
    stats = {k: v.clone() for k, v in tower.state_dict().items() if "running" in k or "num_batches" in k}
    assert stats
    out = tower()
    feats = tower.encode(None, None)  # a 2-row dummy: BatchNorm on 1x1 maps needs more than one value per channel
    assert feats.shape == (0, 16) and feats.grad_fn is not None
    for key, value in tower.state_dict().items():  # the dummy's batch statistics were put back
        if key in stats:
            assert torch.equal(value, stats[key]), key
    out["loss"].backward()
    assert out["loss"].item() == 0.0
    grads = [p.grad for p in tower.vision.parameters()]
    assert all(g is not None for g in grads)  # backward ran (its collectives would have)
    assert all(torch.count_nonzero(g) == 0 for g in grads)  # and contributed nothing


def test_no_rank_with_input_skips_the_module_everywhere_unless_an_accumulation_window_must_close(tower, distributed):
    distributed["others"] = False
    assert tower.encode(None, None) is None and tower not in missing.PENDING
    images = torch.rand(2, 1, 4, 4), torch.ones(2, 1, 1, 1, dtype=torch.bool)
    tower.prepared.syncing = False  # a micro-step inside the window: this rank has images
    assert tower.encode(*images).shape == (2, 16)
    tower.prepared.syncing = True  # the window's last micro-step, no image anywhere: the dummy runs (sync)
    assert tower.encode(None, None).shape == (0, 16) and tower in missing.PENDING
    missing.PENDING.pop(tower)
    assert tower.encode(None, None) is None  # the next window starts clean
    with torch.no_grad():  # evaluation: no gradient to reduce
        tower.prepared.syncing = False
        tower.encode(*images)
        tower.prepared.syncing = True
        assert tower.encode(None, None) is None


def test_0_rows_join_a_tuple_output_or_the_logits_without_a_loss(tower, distributed):
    tower.encode(None, None)
    out = missing.keep_in_graph(tower, (), (torch.ones((), requires_grad=True), "x"))
    out[0].backward()
    assert isinstance(out, tuple) and out[1] == "x"
    assert all(p.grad is not None for p in tower.vision.parameters())
    tower.zero_grad(set_to_none=True)
    tower.encode(None, None)
    logits = torch.ones(2, 3, requires_grad=True)
    out = missing.keep_in_graph(tower, (), {"loss": None, "logits": logits})
    out["logits"].sum().backward()
    assert all(p.grad is not None for p in tower.vision.parameters())


def test_activation_checkpointing_recompute_leaves_batchnorm_statistics_alone(tower, distributed):
    tower.checkpointed = True
    stats = {k: v.clone() for k, v in tower.state_dict().items() if "running" in k}
    tower()["loss"].backward()
    assert all(torch.equal(tower.state_dict()[k], v) for k, v in stats.items())


def test_a_stale_dummy_from_a_forward_that_raised_is_dropped(tower, distributed):
    tower.encode(None, None)  # as if forward raised after the entry point
    assert tower in missing.PENDING
    tower(torch.rand(2, 1, 4, 4), torch.ones(2, 1, 1, 1, dtype=torch.bool))
    assert tower not in missing.PENDING


def test_an_entry_point_without_named_inputs_is_refused():
    with pytest.raises(ValueError, match=r"encode must take each input column as a named parameter; missing "
                                         r"\['pixel_values'\]"):
        def encode(self, **kwargs):
            return None

        offline_encoder(module="vision", inputs=["pixel_values"], output="f")(encode)


def test_one_process_runs_the_method_as_written(tower):
    assert tower.encode(None, None) is None
    assert tower.encode(torch.rand(2, 1, 16, 16), torch.ones(2, 1, 1, 1, dtype=torch.bool)).shape == (2, 16)
    assert tower.encode(torch.rand(0, 1, 16, 16), torch.ones(0, 1, 1, 1, dtype=torch.bool)) is None  # 0 rows: none


def test_inputs_partly_none_are_refused_naming_the_module(tower, distributed):
    with pytest.raises(ValueError, match=r"module 'vision': encode got \['pixel_values'\] but None for \['mask'\]"):
        tower.encode(torch.rand(2, 1, 4, 4), None)


class TwoTowers(Tower):
    @offline_encoder(module="audio", inputs=["pixel_values", "mask"], output="audio_features")
    def encode_audio(self, pixel_values, mask):
        return self.audio(pixel_values=pixel_values * mask).pooler_output.flatten(1)

    def forward(self, images=None, sounds=None):
        return {"loss": torch.cat([self.encode(*(images or (None, None))),
                                   self.encode_audio(*(sounds or (None, None)))]).square().mean()}


def test_only_the_dummy_buffer_changes_are_put_back(tower, monkeypatch):
    """No image on this rank, sounds on every rank: the audio tower's BatchNorm statistics move, vision's do not."""
    model = TwoTowers.from_modules({"vision": tower.vision, "audio": copy.deepcopy(tower.vision)}).train()
    stub_exchange(model, monkeypatch)
    stats = {k: v.clone() for k, v in model.state_dict().items() if "running_mean" in k}
    model(sounds=(torch.rand(2, 1, 4, 4), torch.ones(2, 1, 1, 1, dtype=torch.bool)))["loss"].backward()
    moved = {k.split(".")[0] for k, v in model.state_dict().items() if k in stats and not torch.equal(v, stats[k])}
    assert moved == {"audio"}


def test_an_offline_module_given_its_inputs_runs_without_an_exchange(tower, distributed, monkeypatch):
    """The ranks given cached outputs never call the entry point: an exchange here would wait for them forever."""
    tower.slots["vision"].stage = Stage.OFFLINE  # offline (its strategy stands in for another module's)
    monkeypatch.setattr(exchange_module, "share_inputs", lambda *a, **k: pytest.fail("exchanged for an offline module"))
    assert tower.encode(torch.rand(2, 1, 4, 4), torch.ones(2, 1, 1, 1, dtype=torch.bool)).shape == (2, 16)


class PlannedTowers(Tower):
    """Both entry points' inputs are forward's arguments: one exchange before forward serves both."""

    @offline_encoder(module="audio", inputs=["sound", "sound_mask"], output="audio_features")
    def encode_audio(self, sound, sound_mask):
        return self.audio(pixel_values=sound * sound_mask).pooler_output.flatten(1)

    def forward(self, pixel_values=None, mask=None, sound=None, sound_mask=None, drop=False, make=False):
        if make:  # forward makes inputs it was not given: unlike what every rank shared
            pixel_values, mask = torch.rand(2, 1, 4, 4), torch.ones(2, 1, 1, 1, dtype=torch.bool)
        images = self.encode(None if drop else pixel_values, None if drop else mask)
        sounds = self.encode_audio(sound, sound_mask)
        return {"loss": torch.cat([f for f in (images, sounds) if f is not None]).square().mean()}


def two_towers(tower, monkeypatch, cls):
    model = cls.from_modules({"vision": tower.vision, "audio": copy.deepcopy(tower.vision)}).train()
    return model, stub_exchange(model, monkeypatch)


IMAGES = {"pixel_values": torch.rand(2, 1, 4, 4), "mask": torch.ones(2, 1, 1, 1, dtype=torch.bool)}
SOUNDS = {"sound": torch.rand(2, 1, 4, 4), "sound_mask": torch.ones(2, 1, 1, 1, dtype=torch.bool)}


def test_entry_points_given_forwards_arguments_share_them_in_one_exchange_per_forward(tower, monkeypatch):
    model, exchange = two_towers(tower, monkeypatch, PlannedTowers)
    model(**IMAGES, **SOUNDS)["loss"].backward()
    model(**SOUNDS)["loss"].backward()  # no image here, the other rank has one: vision runs on its dummy
    assert exchange["calls"] == 2
    assert all(p.grad is not None for p in model.vision.parameters())
    unplanned, exchange = two_towers(tower, monkeypatch, TwoTowers)  # inputs under other names: one per call
    unplanned(images=tuple(IMAGES.values()), sounds=tuple(SOUNDS.values()))
    assert exchange["calls"] == 2


def test_a_forward_that_drops_its_given_inputs_runs_the_module_on_them(tower, monkeypatch):
    """Every rank learnt before forward that this one has images: it must join vision's collectives."""
    model, exchange = two_towers(tower, monkeypatch, PlannedTowers)
    exchange["others"] = False
    calls = []
    model.vision.register_forward_hook(lambda module, args, out: calls.append(len(out.pooler_output)))
    model(**IMAGES, **SOUNDS, drop=True)["loss"].backward()
    assert calls == [2]  # the dummy: this rank's own first image, twice
    assert all(p.grad is not None and not p.grad.any() for p in model.vision.parameters())  # reached, adding 0


def test_inputs_forward_makes_where_no_rank_was_given_any_are_refused(tower, monkeypatch):
    model, exchange = two_towers(tower, monkeypatch, PlannedTowers)
    exchange["others"] = False
    with pytest.raises(ValueError, match=r"module 'vision': encode was called on this rank with \['pixel_values', "
                                         r"'mask'\] of its inputs .* unlike forward's arguments of those names"):
        model(**SOUNDS, make=True)


def test_forwards_arguments_given_in_part_are_refused_before_any_module_runs(tower, monkeypatch):
    model, _ = two_towers(tower, monkeypatch, PlannedTowers)
    calls = []
    for module in (model.vision, model.audio):
        module.register_forward_hook(lambda module, args, out: calls.append(module))
    with pytest.raises(ValueError, match=r"module 'audio': encode_audio got \['sound'\] but None for "
                                         r"\['sound_mask'\].*every rank raises this"):
        model(**IMAGES, sound=SOUNDS["sound"])
    assert calls == []


def window_gather(model, monkeypatch, others_have_images: bool) -> list:
    """`window.all_gather_host` over 2 ranks: the other rank's batches are this rank's, with IMAGES where asked."""
    import hf_omni.offline.window as window_module

    calls = []

    def gather(table, group):
        calls.append(len(table))
        if not others_have_images:
            return [table, table]
        rows = exchange_module.own_rows({"vision": IMAGES, "audio": SOUNDS})[:-1]  # PlannedTowers: two entry points
        return [table, [table[0]] + rows * ((len(table) - 1) // len(rows))]

    monkeypatch.setattr(window_module, "all_gather_host", gather)
    monkeypatch.setattr(window_module, "checkpoint_group", lambda: None)
    return calls


def test_a_window_agreed_in_one_all_gather_serves_each_of_its_forwards(tower, monkeypatch):
    """Two micro-batches agreed up front (one all-gather): their forwards run no exchange of their own, in order;
    a forward unlike the next batch, one without gradients, and one after the window exchange as before."""
    from hf_omni.offline.window import agree_window

    model, exchange = two_towers(tower, monkeypatch, PlannedTowers)
    gathers = window_gather(model, monkeypatch, others_have_images=False)
    first, second = {**IMAGES, **SOUNDS}, {**SOUNDS}
    assert agree_window(model, [first, second])
    assert len(gathers) == 1 and exchange["calls"] == 0
    model(**SOUNDS, pixel_values=torch.rand(2, 1, 8, 8), mask=IMAGES["mask"])  # not the next batch: its own exchange
    assert exchange["calls"] == 1
    with torch.no_grad():
        model(**first)  # evaluation: its own exchange, the window kept
    assert exchange["calls"] == 2
    calls = []
    model.vision.register_forward_hook(lambda module, args, out: calls.append(len(out.pooler_output)))
    model(**first)["loss"].backward()
    model(**second)["loss"].backward()  # no image on any rank (as agreed): vision skipped
    assert exchange["calls"] == 2 and calls == [2]
    model(**second)  # the window is spent
    assert exchange["calls"] == 3 and len(gathers) == 1


def test_a_window_tells_a_rank_without_images_to_run_the_dummy(tower, monkeypatch):
    from hf_omni.offline.window import agree_window

    model, exchange = two_towers(tower, monkeypatch, PlannedTowers)
    window_gather(model, monkeypatch, others_have_images=True)
    assert agree_window(model, [dict(SOUNDS)])
    calls = []
    model.vision.register_forward_hook(lambda module, args, out: calls.append(len(out.pooler_output)))
    model(**SOUNDS)["loss"].backward()
    assert exchange["calls"] == 0 and calls == [2]  # the dummy: the other rank's row, twice
    assert all(p.grad is not None and not p.grad.any() for p in model.vision.parameters())


def test_under_turns_a_batch_answer_goes_to_its_training_steps_first_forward_only(tower, monkeypatch):
    from hf_omni.offline.window import agree_window, begin_turn

    model, exchange = two_towers(tower, monkeypatch, PlannedTowers)
    window_gather(model, monkeypatch, others_have_images=False)
    batch = {**IMAGES, **SOUNDS}
    assert agree_window(model, [batch, batch], size=2, turns=True)
    model(**batch)  # outside a training step: its own exchange
    begin_turn(model)
    model(**SOUNDS)  # unlike its batch: its own exchange, and the batch's answer dropped
    model(**batch)  # the same step's second forward: its own exchange (never the next batch's answer)
    assert exchange["calls"] == 3
    begin_turn(model)
    model(**batch)
    assert exchange["calls"] == 3


def test_an_entry_point_called_unlike_its_window_plan_is_kept_for_the_windows_next_agreement(tower, monkeypatch):
    """Inside the window no collective tells the other ranks: the rank keeps the error, runs the call as the plan
    says (no rank had images: vision skipped), and raises it at the next agreement, as every rank does there
    (tests/test_exchange_errors.py, 2 processes)."""
    import torch.distributed as dist

    from hf_omni.offline.window import agree_window, deferred_problem

    model, _ = two_towers(tower, monkeypatch, PlannedTowers)
    window_gather(model, monkeypatch, others_have_images=False)
    assert agree_window(model, [dict(SOUNDS)])
    calls = []
    model.vision.register_forward_hook(lambda module, args, out: calls.append(len(out.pooler_output)))
    model(**SOUNDS, make=True)["loss"].backward()
    said = (r"encode was called on this rank with \['pixel_values', 'mask'\] .*"
            r"\(on rank 0, inside an accumulation window\)")
    assert calls == [] and re.search(said, deferred_problem(model)), deferred_problem(model)
    monkeypatch.setattr(dist, "all_gather_object",  # the other rank kept nothing
                        lambda out, obj, group=None: out.__setitem__(slice(None), [obj, None]))
    with pytest.raises(ValueError, match=said + "; every rank raises this at the window's next agreement"):
        agree_window(model, [dict(SOUNDS)])
    assert deferred_problem(model) is None


def test_a_window_with_a_wrong_batch_queues_nothing(tower, monkeypatch):
    """The forward's own exchange raises the error on every rank, as without a window."""
    from hf_omni.offline.window import agree_window

    model, _ = two_towers(tower, monkeypatch, PlannedTowers)
    window_gather(model, monkeypatch, others_have_images=False)
    assert not agree_window(model, [{**IMAGES, "sound": SOUNDS["sound"]}])
    with pytest.raises(ValueError, match=r"encode_audio got \['sound'\] but None for \['sound_mask'\]"):
        model(**IMAGES, sound=SOUNDS["sound"])


def test_a_generate_call_exchanges_at_its_prefill_and_first_decoding_step_only(tower, monkeypatch):
    """`generate` (wrapped for every OmniModel subclass that has one) over 6 tokens: transformers drops
    `pixel_values` after the prefill on every rank, so the forwards exchange twice, then take the first decoding
    step's answer; a later forward given other inputs raises."""
    from transformers import GenerationMixin

    from hf_omni.offline.window import CALLS

    class Generating(PlannedTowers, GenerationMixin):
        def generate(self, tokens=6, late=None, **inputs):  # transformers' loop, as far as the exchange sees it
            with torch.no_grad():
                self(**inputs)
                for step in range(1, tokens):
                    self(**(late if step == tokens - 1 and late else {k: v for k, v in inputs.items()
                                                                      if k not in IMAGES}))
                return CALLS[self].exchanges

    assert Generating.generate.exchange_per_call
    model, exchange = two_towers(tower, monkeypatch, Generating)
    assert model.generate(**IMAGES, **SOUNDS) == 2 and exchange["calls"] == 2
    assert model.generate(**IMAGES, **SOUNDS) == 2 and exchange["calls"] == 4  # each call agrees anew
    with pytest.raises(ValueError, match=r"Generating.generate: forward 5 of this call on rank 0 was given the entry "
                                         r"points' inputs unlike its first decoding step"):
        model.generate(late={**IMAGES, **SOUNDS}, **IMAGES, **SOUNDS)
    assert model not in CALLS
