"""Released omni models adopted as they are (one process), through the training steps their classes lack
(`hf_omni/adopt/omni/`): Qwen2.5-Omni's thinker and talker trained jointly, Janus' understanding and image
generation from mixed batches. Each step's layout equals the one the release's own `generate` builds (logits at
every generated token), training equals a hand-written per-row loop, `loss/<module>` adds up to `loss`, and the
export loads with the released class, its `generate` equal to the trained model's."""

import copy
import json
import os

import pytest
import torch
import torch.nn.functional as F
from helpers import make_args, step_losses
from omni_models import (
    JANUS, JANUS_BOI, JANUS_TOKENS, Q3_CODEC_END, Q3_GROUPS, Q3_IM_END, Q3_SPEAKER, QWEN2_5_OMNI, QWEN3_OMNI, SPEAKER,
    JanusRows, OmniRows, Qwen3OmniRows, collate, janus, janus_collate, qwen2_5_omni, qwen3_omni,
)

from hf_omni import OmniModel, OmniTrainer

FROZEN = {"audio": {"trainable": False}, "vision": {"trainable": False}, "token2wav": {"trainable": False}}
LORA = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]}


def test_the_talker_layout_equals_the_one_generate_builds():
    """Greedy `generate` (text, then speech codes) on prompts with a clip and an image, one left-padded; the same
    prompts, replies and codes through the training step: the talker's logits at every code equal generate's."""
    released = qwen2_5_omni().eval()
    model = OmniModel.from_model(released, modules=QWEN2_5_OMNI)
    rows = OmniRows(2, seed=3, audio_every=1, image_every=2)
    prompts = [{k: v for k, v in r.items()} for r in rows]
    for row in prompts:  # the prompt alone
        keep = row["labels"] == -100
        row["input_ids"], row["labels"] = row["input_ids"][keep], row["labels"][keep]
    batch = collate(prompts)
    del batch["labels"], batch["codec_ids"], batch["speaker_token_ids"]
    shown = {"thinker_pixel_values": batch["pixel_values"]}  # the release's generate hands unprefixed pixels to
    captured = {}                                             # its talker too, which refuses them
    talker_generate = released.talker.generate

    def recording(*args, **kwargs):
        out = talker_generate(*args, output_logits=True, return_dict_in_generate=True, **kwargs)
        captured["codes"] = out.sequences[:, kwargs["input_ids"].shape[1]:]
        captured["logits"] = torch.stack(out.logits, 1)
        return out.sequences

    released.talker.generate = recording
    with torch.no_grad():
        sequences, _ = released.generate(**{k: v for k, v in batch.items() if k != "pixel_values"}, **shown,
                                         speaker="Tiny", thinker_max_new_tokens=5, thinker_do_sample=False,
                                         talker_max_new_tokens=7, talker_do_sample=False, talker_eos_token_id=[125],
                                         talker_repetition_penalty=1.0, token2wav_num_steps=2)
    prompt_width = batch["input_ids"].shape[1]
    replies, codes = sequences[:, prompt_width:], captured["codes"].clone()
    for i in range(2):  # each row's reply up to its end-of-turn; its codes up to the codec end
        ended = (replies[i] == 5).nonzero()
        if len(ended):
            replies[i, ended[0, 0] + 1:] = -100
        ended = (codes[i] == 125).nonzero()
        if len(ended):
            codes[i, ended[0, 0] + 1:] = -100
    answered = replies != -100
    step = dict(batch, input_ids=torch.cat([batch["input_ids"], replies.clamp(min=0)], 1),
                attention_mask=torch.cat([batch["attention_mask"], answered.long()], 1),
                labels=torch.cat([torch.full_like(batch["input_ids"], -100), replies], 1), codec_ids=codes,
                speaker_token_ids=torch.tensor([SPEAKER, SPEAKER]))
    seen = []
    hook = released.talker.codec_head.register_forward_hook(lambda m, a, out: seen.append(out))
    with torch.no_grad():
        out = model(**step)
    hook.remove()
    assert set(out.losses) == {"text", "codec"}
    logits = seen[0]
    for i in range(2):
        n = int((codes[i] != -100).sum())
        assert n >= 2
        start = int(answered[i].long().argmax()) + prompt_width  # the talker's column of the reply's first token
        # the columns after the reply's first token each predict the next code
        got = logits[i, start + 1:start + 1 + n]
        assert (got - captured["logits"][i, :n]).abs().max().item() <= 1e-5


def reference_step(model, rows: list[dict], text_count, codec_count):
    """Plain PyTorch on the released parts, row by row: the thinker on the collated batch; each row's talker input
    concatenated from its own pieces (no padding), numbered by the talker's `get_rope_index` on that row alone."""
    released = model.released
    thinker, talker = released.thinker, released.talker
    batch = collate(rows)
    media = {k: batch[k] for k in ("pixel_values", "image_grid_thw", "input_features", "feature_attention_mask")
             if k in batch}
    out = thinker(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], output_hidden_states=True,
                  use_cache=False, **media)
    labels = batch["labels"]
    text = F.cross_entropy(out.logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(), reduction="sum")
    embeds = out.hidden_states[0].clone()
    for token in (100, 101, 102):
        embeds = torch.where((batch["input_ids"] == token)[..., None], torch.zeros_like(embeds), embeds)
    states = out.hidden_states[-1] + embeds
    word = lambda t: thinker.get_input_embeddings()(torch.tensor([t]))[0]  # noqa: E731
    code = lambda t: talker.get_input_embeddings()(torch.tensor([t]))[0]  # noqa: E731
    codec = torch.zeros(())
    for i, row in enumerate(rows):
        codes = row["codec_ids"][row["codec_ids"] != -100].tolist()
        if not codes:
            continue
        width = batch["input_ids"].shape[1]
        offset = width - len(row["input_ids"])
        prompt = int((row["labels"] == -100).sum())
        reply = len(row["input_ids"]) - prompt
        s = offset + prompt
        stream = [states[i, s + k] for k in range(1, reply - 1)] + [word(111)] + [word(112)] * len(codes)
        pieces = [states[i, offset:s], (word(SPEAKER) + code(126))[None], (states[i, s] + code(124))[None]]
        pieces += [(code(codes[k - 1]) + stream[k - 1])[None] for k in range(1, len(codes))]
        x = torch.cat(pieces)[None]
        ids = torch.tensor(row["input_ids"][:prompt].tolist() + [SPEAKER, int(row["input_ids"][prompt])]
                           + [SPEAKER] * (len(codes) - 1))[None]
        grid = row["image_grid_thw"][None] if "image_grid_thw" in row else None
        lengths = row["feature_attention_mask"].sum()[None] if "feature_attention_mask" in row else None
        positions, _ = talker.get_rope_index(ids, grid, None, torch.ones_like(ids), False, lengths, None)
        logits = talker(inputs_embeds=x, position_ids=positions, attention_mask=torch.ones_like(ids),
                        use_cache=False).logits[0, prompt + 1:]
        codec = codec + F.cross_entropy(logits.float(), torch.tensor(codes), reduction="sum")
    return text / text_count, codec / codec_count


def test_thinker_and_talker_trained_jointly_equal_a_hand_written_loop(tmp_path):
    """Towers and token2wav frozen, the thinker's LLM and the talker trained (their own rates) from rows of text,
    image and audio prompts, some without speech; 2 accumulation micro-steps. Losses per step, `loss/<module>`, and
    every weight after 4 steps against plain PyTorch."""
    model = OmniModel.from_model(qwen2_5_omni(), modules=QWEN2_5_OMNI)
    reference = copy.deepcopy(model)
    rows = OmniRows(32)
    modules = {**FROZEN, "llm": {"learning_rate": 1e-3}, "talker": {"learning_rate": 3e-3}}
    trainer = OmniTrainer(model=model, args=make_args(tmp_path, modules=modules, lr_scheduler_type="constant",
                                                      max_grad_norm=0, per_device_train_batch_size=4,
                                                      gradient_accumulation_steps=2, adam_epsilon=1e-6),
                          train_dataset=rows, data_collator=collate)
    trainer.train()
    logged = [e for e in trainer.state.log_history if "loss" in e]

    released = reference.released
    released.requires_grad_(False)
    groups = [{"params": list(reference.slots[name].module.parameters()), "lr": lr}
              for name, lr in (("llm", 1e-3), ("talker", 3e-3))]
    for group in groups:
        for p in group["params"]:
            p.requires_grad_(True)
    optimizer = torch.optim.AdamW(groups, weight_decay=0.0, eps=1e-6)  # a near-zero gradient's
    # update at eps 1e-8 swings with the summation order (per row here, batched there): 3e-5 apart after 4 steps
    released.train()
    for name in ("audio", "vision", "token2wav"):
        reference.slots[name].module.eval()
    expected = []
    for start in range(0, 32, 8):
        window = [rows[i] for i in range(start, start + 8)]
        text_count = sum(int((r["labels"][1:] != -100).sum()) for r in window)
        codec_count = sum(int((r["codec_ids"] != -100).sum()) for r in window)
        parts = torch.zeros(2)
        for micro in (window[:4], window[4:]):
            text, codec = reference_step(reference, micro, text_count, codec_count)
            (text + codec).backward()
            parts += torch.stack([text.detach(), codec.detach()])
        optimizer.step()
        optimizer.zero_grad()
        expected.append(parts)
    assert step_losses(trainer) == pytest.approx([float(p.sum()) for p in expected], abs=1e-5)
    assert [e["loss/llm"] for e in logged] == pytest.approx([float(p[0]) for p in expected], abs=1e-5)
    assert [e["loss/talker"] for e in logged] == pytest.approx([float(p[1]) for p in expected], abs=1e-5)
    live, ref = model.released.state_dict(), released.state_dict()
    assert max((live[k] - ref[k]).abs().max().item() for k in live) <= 1e-5  # 2e-7 to 4.4e-7 here
    assert all(torch.equal(live[k], qwen2_5_omni().state_dict()[k]) for k in live if k.startswith("token2wav."))


def test_lora_thinker_full_talker_export_loads_with_the_release_and_generates_the_same(tmp_path):
    """LoRA on the thinker's LLM, the talker in full: the export (merged, the release's own format, its speakers'
    `spk_dict.pt`) loads with `Qwen2_5OmniForConditionalGeneration.from_pretrained`; its text and speech
    `generate` equal the trained model's."""
    model = OmniModel.from_model(qwen2_5_omni(), modules=QWEN2_5_OMNI)
    before = {k: v.clone() for k, v in model.released.state_dict().items()}
    modules = {**FROZEN, "llm": {"lora": LORA, "learning_rate": 1e-2}, "talker": {"learning_rate": 1e-2}}
    trainer = OmniTrainer(model=model, args=make_args(tmp_path / "run", modules=modules),
                          train_dataset=OmniRows(32), data_collator=collate)
    trainer.train()
    trainer.save_model(str(tmp_path / "export"))
    assert os.path.isfile(tmp_path / "export" / "spk_dict.pt")
    cls = type(model.released)
    reloaded = cls.from_pretrained(tmp_path / "export").eval()
    state = reloaded.state_dict()
    changed = {k.split(".")[0] for k in state if not torch.equal(state[k], before[k])}
    assert changed == {"thinker", "talker"}  # LoRA merged into the thinker's LLM; the talker trained
    assert all(torch.equal(state[k], before[k]) for k in state if k.startswith(("thinker.model.audio_tower",
                                                                                  "thinker.model.visual")))
    rows = OmniRows(2, seed=5, audio_every=1, image_every=1)
    prompt = collate([rows[0]])
    prompt = {k: v for k, v in prompt.items() if k not in ("labels", "codec_ids", "speaker_token_ids")}
    prompt["thinker_pixel_values"] = prompt.pop("pixel_values")  # see the layout test
    model.eval()
    kwargs = dict(speaker="Tiny", thinker_max_new_tokens=4, thinker_do_sample=False, thinker_eos_token_id=5,
                  talker_max_new_tokens=5, talker_do_sample=False, talker_eos_token_id=[125], token2wav_num_steps=2)
    with torch.no_grad():
        text = model.generate(**prompt, generation_mode="text", **kwargs)
        assert torch.equal(text, reloaded.generate(**prompt, generation_mode="text", **kwargs))
        torch.manual_seed(0)
        sequences, wave = model.generate(**prompt, **kwargs)
        torch.manual_seed(0)
        sequences_again, wave_again = reloaded.generate(**prompt, **kwargs)
    assert torch.equal(sequences, sequences_again) and wave.numel() > 0
    assert (wave - wave_again).abs().max().item() <= 1e-5
    again = OmniModel.from_pretrained(tmp_path / "export")
    assert again.module_names == list(QWEN2_5_OMNI) and again.released.speaker_map.keys() == {"Tiny"}


def test_codec_targets_without_a_talker_or_a_speaker_are_refused():
    released = qwen2_5_omni()
    model = OmniModel.from_model(released, modules=QWEN2_5_OMNI)
    batch = collate([OmniRows(1)[0]])
    with pytest.raises(ValueError, match="codec_ids need the reply they speak .* and speaker_token_ids"):
        model(**{k: v for k, v in batch.items() if k != "speaker_token_ids"})


def test_the_janus_image_layout_equals_the_one_generate_builds():
    """Greedy `generate(generation_mode="image")` on two prompts (one left-padded); the prompts and the drawn tokens
    through the training step: `generation_head`'s scores at every image token equal generate's."""
    released = janus().eval()
    model = OmniModel.from_model(released, modules=JANUS)
    prompts = janus_collate([{"generation_input_ids": torch.tensor([5, 6, 7, JANUS_BOI]),
                              "generation_pixel_values": torch.zeros(3, 16, 16)},
                             {"generation_input_ids": torch.tensor([8, 9, JANUS_BOI]),
                              "generation_pixel_values": torch.zeros(3, 16, 16)}])
    seen = []
    hook = released.model.generation_head.register_forward_hook(lambda m, a, out: seen.append(out))
    with torch.no_grad():
        drawn = released.generate(prompts["generation_input_ids"], attention_mask=prompts["generation_attention_mask"],
                                  generation_mode="image", do_sample=False, guidance_scale=2.0)
        steps = torch.stack([scores[:2] for scores in seen], 1)  # the conditional half of each step's batch
        seen.clear()
        out = model(generation_input_ids=prompts["generation_input_ids"],
                    generation_attention_mask=prompts["generation_attention_mask"], generation_image_ids=drawn)
    hook.remove()
    assert drawn.shape == (2, JANUS_TOKENS) and set(out.losses) == {"image"}
    assert (seen[0] - steps).abs().max().item() <= 1e-5


def janus_reference(model, rows: list[dict], text_count, image_count):
    """Plain PyTorch, each kind of row on its own: understanding rows through the release's own forward (positions
    from the mask), each generation row alone, unpadded: its prompt's embeddings, its image tokens' generation
    embeddings, the language model, `generation_head`."""
    released = model.released
    reading = [r for r in rows if "input_ids" in r]
    text = torch.zeros(())
    if reading:
        batch = janus_collate(reading)
        mask = batch["attention_mask"]
        positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)
        text = released(**batch, position_ids=positions, num_items_in_batch=text_count, use_cache=False).loss
    image = torch.zeros(())
    for row in rows:
        if "generation_input_ids" not in row:
            continue
        with torch.no_grad():
            tokens = released.model.vqmodel.encode(row["generation_pixel_values"][None]).image_tokens.view(1, -1)
        embeds = torch.cat([released.get_input_embeddings()(row["generation_input_ids"][None]),
                            released.prepare_embeddings_for_image_generation(tokens[:, :-1])], 1)
        hidden = released.model.language_model(inputs_embeds=embeds, use_cache=False).last_hidden_state
        scores = released.model.generation_head(hidden[0, -JANUS_TOKENS:])
        image = image + F.cross_entropy(scores.float(), tokens[0], reduction="sum")
    return text, image / image_count


def test_janus_understanding_and_generation_rows_equal_a_hand_written_loop(tmp_path):
    """Mixed batches of captioning rows and drawing rows; vision tower and VQ model frozen, the aligner, the
    generation heads and the language model trained at their own rates: losses, `loss/<module>` and every weight
    after 4 steps against plain PyTorch."""
    model = OmniModel.from_model(janus(), modules=JANUS)
    reference = copy.deepcopy(model)
    rows = JanusRows(32)
    rates = {"aligner": 1e-2, "generation": 3e-3, "llm": 1e-3}
    modules = {"vision": {"trainable": False}, "vq": {"trainable": False},
               **{name: {"learning_rate": lr} for name, lr in rates.items()}}
    trainer = OmniTrainer(model=model, args=make_args(tmp_path, modules=modules, lr_scheduler_type="constant",
                                                      max_grad_norm=0, adam_epsilon=1e-6),
                          train_dataset=rows, data_collator=janus_collate)
    trainer.train()
    logged = [e for e in trainer.state.log_history if "loss" in e]

    released = reference.released
    released.requires_grad_(False)
    groups = [{"params": list(reference.slots[name].module.parameters()), "lr": lr} for name, lr in rates.items()]
    for group in groups:
        for p in group["params"]:
            p.requires_grad_(True)
    optimizer = torch.optim.AdamW(groups, weight_decay=0.0, eps=1e-6)  # a near-zero gradient's
    # update at eps 1e-8 swings with the summation order (per row here, batched there): 3e-5 apart after 4 steps
    released.train()
    for name in ("vision", "vq"):
        reference.slots[name].module.eval()
    expected = []
    for start in range(0, 32, 8):
        window = [rows[i] for i in range(start, start + 8)]
        text_count = sum(int((r["labels"][1:] != -100).sum()) for r in window if "labels" in r)
        image_count = JANUS_TOKENS * sum("generation_input_ids" in r for r in window)
        text, image = janus_reference(reference, window, text_count, image_count)
        (text + image).backward()
        optimizer.step()
        optimizer.zero_grad()
        expected.append((float(text), float(image)))
    assert step_losses(trainer) == pytest.approx([a + b for a, b in expected], abs=1e-5)
    assert [e["loss/llm"] for e in logged] == pytest.approx([a for a, _ in expected], abs=1e-5)
    assert [e["loss/generation"] for e in logged] == pytest.approx([b for _, b in expected], abs=1e-5)
    live, ref = model.released.state_dict(), released.state_dict()
    assert max((live[k] - ref[k]).abs().max().item() for k in live) <= 1e-5  # 2e-7 to 4.4e-7 here
    fresh = janus().state_dict()
    assert all(torch.equal(live[k], fresh[k]) for k in live if k.startswith(("model.vqmodel.", "model.vision_model.")))


def test_janus_export_loads_with_the_release_and_draws_the_same(tmp_path):
    """LoRA on the language model, the generation heads trained: the export loads with
    `JanusForConditionalGeneration.from_pretrained`; its image and text `generate` equal the trained model's."""
    model = OmniModel.from_model(janus(), modules=JANUS)
    modules = {"vision": {"trainable": False}, "vq": {"trainable": False}, "aligner": {"learning_rate": 1e-2},
               "generation": {"learning_rate": 1e-2}, "llm": {"lora": LORA, "learning_rate": 1e-2}}
    trainer = OmniTrainer(model=model, args=make_args(tmp_path / "run", modules=modules),
                          train_dataset=JanusRows(32), data_collator=janus_collate)
    trainer.train()
    trainer.save_model(str(tmp_path / "export"))
    reloaded = type(model.released).from_pretrained(tmp_path / "export").eval()
    saved = json.load(open(tmp_path / "export" / "generation_config.json"))["generation_kwargs"]
    assert saved == {"boi_token_id": JANUS_BOI, "num_image_tokens": JANUS_TOKENS}
    reloaded.generation_config.generation_kwargs = saved  # written, but not read back by from_pretrained (5.23-5.25)
    model.eval()
    prompt = torch.tensor([[5, 6, 7, JANUS_BOI]])
    reading = janus_collate([JanusRows(2)[1]])
    with torch.no_grad():
        kwargs = dict(attention_mask=torch.ones_like(prompt), generation_mode="image", do_sample=False)
        drawn = model.generate(prompt, **kwargs)
        assert torch.equal(drawn, reloaded.generate(prompt, **kwargs))
        assert reloaded.decode_image_tokens(drawn).shape == (1, 16, 16, 3)
        text = dict(max_new_tokens=3, do_sample=False)
        assert torch.equal(model.generate(**{k: v for k, v in reading.items() if k != "labels"}, **text),
                           reloaded.generate(**{k: v for k, v in reading.items() if k != "labels"}, **text))


def test_the_qwen3_talker_layout_equals_the_one_generate_builds():
    """Greedy speech `generate` on two chat prompts with a clip and an image (one left-padded); the prompts,
    replies and every codebook's codes through the training step: the talker's first-codebook logits and the code
    predictor's logits for every other codebook equal generate's, frame by frame."""
    released = qwen3_omni().eval()
    model = OmniModel.from_model(released, modules=QWEN3_OMNI)
    rows = Qwen3OmniRows(2, seed=3, audio_every=1, image_every=2)
    prompts = []
    for row in rows:
        keep = row["labels"] == -100
        prompts.append(dict(row, input_ids=row["input_ids"][keep], labels=row["labels"][keep]))
    batch = collate(prompts)
    for key in ("labels", "codec_ids", "speaker_token_ids"):
        del batch[key]
    heads = {"first": [], **{g: [] for g in range(1, Q3_GROUPS)}}
    hooks = [released.talker.codec_head.register_forward_hook(lambda m, a, out: heads["first"].append(out[:, -1]))]
    for g in range(1, Q3_GROUPS):
        hooks.append(released.talker.code_predictor.lm_head[g - 1].register_forward_hook(
            lambda m, a, out, g=g: heads[g].append(out[:, -1])))
    predicted = []
    predictor_generate = released.talker.code_predictor.generate

    def recording(*args, **kwargs):
        out = predictor_generate(*args, **kwargs)
        predicted.append(out.sequences[:, -(Q3_GROUPS - 1):])
        return out

    released.talker.code_predictor.generate = recording
    talker_generate = released.talker.generate

    def talking(*args, **kwargs):
        out = talker_generate(*args, **kwargs)
        predicted.insert(0, out.sequences)  # the first codebook's codes, as fed back
        return out

    released.talker.generate = talking
    with torch.no_grad():
        sequences, _ = released.generate(**batch, speaker="tiny", thinker_max_new_tokens=5,  # rows of one length
                                         thinker_do_sample=False, thinker_eos_token_id=Q3_IM_END,
                                         thinker_suppress_tokens=list(range(140, 160)),  # no media, no end:
                                         talker_max_new_tokens=6, talker_do_sample=False,
                                         talker_repetition_penalty=1.0)
    for hook in hooks:
        hook.remove()
    first = torch.stack(heads["first"], 1)  # (rows, frames, codes): one per talker step
    drawn = {g: torch.stack(heads[g], 1) for g in range(1, Q3_GROUPS)}  # (rows, frames - 1, codes)
    codes = torch.full((2, first.shape[1], Q3_GROUPS), -100)
    codes[..., 0] = predicted[0][:, -first.shape[1]:]
    for k, residual in enumerate(predicted[1:]):  # frame k's other codebooks, drawn at step k + 1
        codes[:, k, 1:] = residual
    prompt_width = batch["input_ids"].shape[1]
    replies = sequences[:, prompt_width:].clone()
    for i in range(2):
        ended = (replies[i] == Q3_IM_END).nonzero()
        if len(ended):
            replies[i, ended[0, 0] + 1:] = -100
        ended = (codes[i, :, 0] == Q3_CODEC_END).nonzero()
        if len(ended):
            codes[i, ended[0, 0] + 1:] = -100
            codes[i, ended[0, 0], 1:] = -100
    answered = replies != -100
    step = dict(batch, input_ids=torch.cat([batch["input_ids"], replies.clamp(min=0)], 1),
                attention_mask=torch.cat([batch["attention_mask"], answered.long()], 1),
                labels=torch.cat([torch.full_like(batch["input_ids"], -100), replies], 1), codec_ids=codes,
                speaker_token_ids=torch.tensor([Q3_SPEAKER, Q3_SPEAKER]))
    for key in heads:
        heads[key].clear()
    hooks = [released.talker.codec_head.register_forward_hook(lambda m, a, out: heads["first"].append(out))]
    for g in range(1, Q3_GROUPS):
        hooks.append(released.talker.code_predictor.lm_head[g - 1].register_forward_hook(
            lambda m, a, out, g=g: heads[g].append(out)))
    with torch.no_grad():
        out = model(**step)
    for hook in hooks:
        hook.remove()
    assert set(out.losses) == {"text", "codec"}
    for i in range(2):
        frames = int((codes[i, :, 0] != -100).sum())
        assert frames >= 2
        assert (heads["first"][0][i, :frames] - first[i, :frames]).abs().max().item() <= 1e-5
        for g in range(1, Q3_GROUPS):  # the frames whose other codebooks generate drew
            trained = heads[g][0].view(2, codes.shape[1], -1)[i, :frames - 1]
            assert (trained - drawn[g][i, :frames - 1]).abs().max().item() <= 1e-5


def qwen3_reference(model, rows: list[dict], text_count, codec_count):
    """Plain PyTorch on the released parts, row by row: the thinker on the collated batch; each row's talker
    sequence assembled piece by piece from its own tokens (its user turns found by walking the turns), unpadded;
    each frame's other codebooks from the code predictor on [predicting state, code 0, code 1, ...]."""
    released = model.released
    thinker, talker, config = released.thinker, released.talker, released.config
    t = config.talker_config
    batch = collate(rows)
    media = {k: batch[k] for k in ("pixel_values", "image_grid_thw", "input_features", "feature_attention_mask")
             if k in batch}
    out = thinker(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], output_hidden_states=True,
                  use_cache=False, **media)
    labels = batch["labels"]
    text = F.cross_entropy(out.logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(), reduction="sum")
    embeds, states = out.hidden_states[0], out.hidden_states[t.accept_hidden_layer]
    word = lambda i: talker.text_projection(thinker.get_input_embeddings()(torch.tensor([i])))[0]  # noqa: E731
    code = lambda i: talker.get_input_embeddings()(torch.tensor([i]))[0]  # noqa: E731
    residual = lambda g, i: talker.code_predictor.get_input_embeddings()[g - 1](torch.tensor([i]))[0]  # noqa: E731
    codec = torch.zeros(())
    width = batch["input_ids"].shape[1]
    for i, row in enumerate(rows):
        codes = row["codec_ids"]
        frames = int((codes[:, 0] != -100).sum())
        if not frames:
            continue
        ids = row["input_ids"].tolist()
        offset = width - len(ids)
        prompt = int((row["labels"] == -100).sum())
        header, reply = prompt - 3, len(ids) - prompt
        role, user = None, []
        for p in range(header):
            role = ids[p + 1] if ids[p] == config.im_start_token_id else role
            if role == config.user_token_id:
                user.append(p)
        pieces = [talker.hidden_projection(states[i, offset + p]) if ids[p] in (140, 141, 142)
                  else talker.text_projection(embeds[i, offset + p]) for p in user]
        spoken = lambda k: talker.text_projection(embeds[i, offset + header + k])  # noqa: E731
        prefix_text = [spoken(0), spoken(1), spoken(2)] + [word(config.tts_pad_token_id)] * 4 + [
            word(config.tts_bos_token_id), spoken(3)]
        prefix_codec = [torch.zeros_like(spoken(0))] * 3 + [code(c) for c in (
            t.codec_nothink_id, t.codec_think_bos_id, t.codec_think_eos_id, Q3_SPEAKER, t.codec_pad_id,
            t.codec_bos_id)]
        pieces += [a + b for a, b in zip(prefix_text, prefix_codec)]
        trailing = [spoken(4 + j) for j in range(reply - 2)] + [word(config.tts_eos_token_id)]
        for k in range(1, frames):
            fed = code(int(codes[k - 1, 0])) + sum(residual(g, int(codes[k - 1, g])) for g in range(1, Q3_GROUPS))
            pieces.append(fed + (trailing[k - 1] if k - 1 < len(trailing) else word(config.tts_pad_token_id)))
        sequence = torch.stack(pieces)[None]
        talker_ids = torch.tensor([ids[p] for p in user] + [config.tts_pad_token_id] * (8 + frames))[None]
        mask = torch.ones_like(talker_ids)
        grid = row["image_grid_thw"][None] if "image_grid_thw" in row else None
        lengths = row["feature_attention_mask"].sum()[None] if "feature_attention_mask" in row else None
        text_positions = torch.arange(talker_ids.shape[1])[None]
        if grid is None and lengths is None:
            vision = text_positions[None].expand(3, -1, -1)
        else:
            vision, _ = talker.get_rope_index(talker_ids, grid, None, mask, False, lengths, None)
        positions = torch.cat([text_positions[None], vision])
        hidden = talker.model(inputs_embeds=sequence, attention_mask=mask, position_ids=positions,
                              use_cache=False).last_hidden_state[0]
        predicting = hidden[len(user) + 8:]
        codec = codec + F.cross_entropy(talker.codec_head(predicting).float(), codes[:frames, 0], reduction="sum")
        for k in range(frames):
            if codes[k, 1] == -100:
                continue
            chain = torch.stack([predicting[k], code(int(codes[k, 0]))] + [
                residual(g, int(codes[k, g])) for g in range(1, Q3_GROUPS - 1)])[None]
            inner = talker.code_predictor.model(inputs_embeds=chain, use_cache=False).last_hidden_state[0]
            for g in range(1, Q3_GROUPS):
                logits = talker.code_predictor.lm_head[g - 1](inner[g])
                codec = codec + F.cross_entropy(logits.float()[None], codes[k, g][None], reduction="sum")
    return text / text_count, codec / codec_count


def test_qwen3_thinker_and_talker_trained_jointly_equal_a_hand_written_loop(tmp_path):
    """Qwen3-Omni-MoE: towers and code2wav frozen, the thinker's MoE LLM and the talker (with its code predictor)
    trained from chat rows with clips, images and 3-codebook speech codes, 2 accumulation micro-steps: losses,
    `loss/<module>` and every weight after 4 steps against plain PyTorch."""
    model = OmniModel.from_model(qwen3_omni(), modules=QWEN3_OMNI)
    reference = copy.deepcopy(model)
    rows = Qwen3OmniRows(32)
    modules = {"audio": {"trainable": False}, "vision": {"trainable": False}, "code2wav": {"trainable": False},
               "llm": {"learning_rate": 1e-3}, "talker": {"learning_rate": 3e-3}}
    trainer = OmniTrainer(model=model, args=make_args(tmp_path, modules=modules, lr_scheduler_type="constant",
                                                      max_grad_norm=0, per_device_train_batch_size=4,
                                                      gradient_accumulation_steps=2, adam_epsilon=1e-6),
                          train_dataset=rows, data_collator=collate)
    trainer.train()
    logged = [e for e in trainer.state.log_history if "loss" in e]

    released = reference.released
    released.requires_grad_(False)
    groups = [{"params": list(reference.slots[name].module.parameters()), "lr": lr}
              for name, lr in (("llm", 1e-3), ("talker", 3e-3))]
    for group in groups:
        for p in group["params"]:
            p.requires_grad_(True)
    optimizer = torch.optim.AdamW(groups, weight_decay=0.0, eps=1e-6)  # a near-zero gradient's
    # update at eps 1e-8 swings with the summation order (per row here, batched there): 3e-5 apart after 4 steps
    released.train()
    for name in ("audio", "vision", "code2wav"):
        reference.slots[name].module.eval()
    expected = []
    for start in range(0, 32, 8):
        window = [rows[i] for i in range(start, start + 8)]
        text_count = sum(int((r["labels"][1:] != -100).sum()) for r in window)
        codec_count = sum(int((r["codec_ids"] != -100).sum()) for r in window)
        parts = torch.zeros(2)
        for micro in (window[:4], window[4:]):
            text, codec = qwen3_reference(reference, micro, text_count, codec_count)
            (text + codec).backward()
            parts += torch.stack([text.detach(), codec.detach()])
        optimizer.step()
        optimizer.zero_grad()
        expected.append(parts)
    assert step_losses(trainer) == pytest.approx([float(p.sum()) for p in expected], abs=1e-5)
    assert [e["loss/llm"] for e in logged] == pytest.approx([float(p[0]) for p in expected], abs=1e-5)
    assert [e["loss/talker"] for e in logged] == pytest.approx([float(p[1]) for p in expected], abs=1e-5)
    live, ref = model.released.state_dict(), released.state_dict()
    assert max((live[k] - ref[k]).abs().max().item() for k in live) <= 1e-5  # 2e-7 to 4.4e-7 here
    changed = {k for k in live if not torch.equal(live[k], qwen3_omni().state_dict()[k])}
    assert any(k.startswith("talker.code_predictor.") for k in changed)  # every codebook's head trained
    assert not any(k.startswith(("code2wav.", "thinker.model.audio_tower.", "thinker.model.visual.")) for k in changed)


def test_qwen3_export_loads_with_the_release_and_speaks_the_same(tmp_path):
    """LoRA on the thinker's MoE LLM, the talker in full: the export loads with
    `Qwen3OmniMoeForConditionalGeneration.from_pretrained`; its text and speech `generate` equal the trained
    model's."""
    model = OmniModel.from_model(qwen3_omni(), modules=QWEN3_OMNI)
    modules = {"audio": {"trainable": False}, "vision": {"trainable": False}, "code2wav": {"trainable": False},
               "llm": {"lora": LORA, "learning_rate": 1e-2}, "talker": {"learning_rate": 1e-2}}
    trainer = OmniTrainer(model=model, args=make_args(tmp_path / "run", modules=modules),
                          train_dataset=Qwen3OmniRows(32), data_collator=collate)
    trainer.train()
    trainer.save_model(str(tmp_path / "export"))
    reloaded = type(model.released).from_pretrained(tmp_path / "export").eval()
    talker_config = reloaded.config.talker_config  # the undeclared field comes back a dict (for audio prompts)
    talker_config.audio_config = type(reloaded.config.thinker_config.audio_config)(**talker_config.audio_config)
    row = Qwen3OmniRows(2, seed=5, audio_every=1, image_every=1)[0]
    keep = row["labels"] == -100
    prompt = collate([dict(row, input_ids=row["input_ids"][keep], labels=row["labels"][keep])])
    prompt = {k: v for k, v in prompt.items() if k not in ("labels", "codec_ids", "speaker_token_ids")}
    model.eval()
    kwargs = dict(speaker="tiny", thinker_max_new_tokens=4, thinker_do_sample=False, thinker_eos_token_id=Q3_IM_END,
                  talker_max_new_tokens=4, talker_do_sample=False,
                  talker_suppress_tokens=list(range(76, 1100)))  # 4 frames: no end token before them
    with torch.no_grad():
        text = model.generate(**prompt, generation_mode="text", **kwargs)
        assert torch.equal(text, reloaded.generate(**prompt, generation_mode="text", **kwargs))
        sequences, wave = model.generate(**prompt, **kwargs)
        sequences_again, wave_again = reloaded.generate(**prompt, **kwargs)
    assert torch.equal(sequences, sequences_again) and wave.numel() > 0
    assert (wave - wave_again).abs().max().item() <= 1e-5


def test_an_omni_vision_tower_served_from_the_offline_cache_trains_as_online(tmp_path):
    """Qwen2.5-Omni's frozen vision tower cached through its thinker's `get_image_features` (the outputs per image,
    the grids kept for the positions), the LLM and talker trained: the same losses and weights as the tower online."""
    rows = OmniRows(32, image_every=2)
    modules = {**FROZEN, "llm": {"learning_rate": 1e-3}, "talker": {"learning_rate": 1e-3}}
    results = []
    for offline in (False, True):
        model = OmniModel.from_model(qwen2_5_omni(), modules=QWEN2_5_OMNI)
        extra = dict(offline_modules=["vision"], offline_cache_dir=str(tmp_path / "cache")) if offline else {}
        settings = {**modules, "vision": {"trainable": False, "offline_encoder": "thinker.get_image_features"}} \
            if offline else modules
        trainer = OmniTrainer(model=model, args=make_args(tmp_path / str(offline), modules=settings, **extra),
                              train_dataset=rows, data_collator=collate)
        trainer.train()
        results.append((step_losses(trainer), {k: v for k, v in model.released.state_dict().items()
                                               if not k.startswith("thinker.model.visual.")}))
    (online, live), (cached, served) = results
    assert online == pytest.approx(cached, abs=1e-6)
    assert max((live[k] - served[k]).abs().max().item() for k in live) <= 1e-6
    assert (tmp_path / "cache").is_dir()
