"""Qwen3-Omni-MoE's training step: the thinker's text loss and the talker's codec loss over every codebook.

`Qwen3OmniMoeForConditionalGeneration` implements no `forward`; its talker's own loss fails
(`Qwen3OmniMoeTalkerConfig` has no `vocab_size`) and would cover the first codebook only (`codec_head`); the other
codebooks are predicted by `talker.code_predictor`, one after another, inside `generate`. This step builds the
talker's inputs from the release's parts, position for position as `generate` lays them out:

    talker:  [user turns][a0 a1 a2 + 0][pad x4 + nothink think_bos think_eos speaker][bos + codec pad][r0 + codec bos]
             [r1 + frame 0] [r2 + frame 1] .. [rR-2 + frame R-3][tts eos + frame R-2][tts pad + frame R-1] ..
    targets: each frame's first code, from the position before it (`codec_head`)
    code predictor, per frame: [talker state that predicted the frame][code 0][code 1] .. [code G-2]
             -> codes 1 .. G-1, each from its own head (`lm_head[g - 1]`)

The user turns are the prompt's tokens whose turn is the user's (its `<|im_start|>user` segments), left-padded:
their text through `talker.text_projection` of the thinker's embeddings, their audio / image / video positions
through `talker.hidden_projection` of the thinker's states at `accept_hidden_layer`. `a0 a1 a2` are the
assistant header (`<|im_start|>assistant\\n`, the three tokens before the reply), `r` the reply (`labels`), each
through `text_projection`; the reply's last token (its end of turn) is never fed, as a single row's `generate`
never feeds it (a batched `generate` feeds it for the rows that end before the longest). A frame's input is the
sum of its codes' embeddings (the talker's for code 0, the code predictor's for the others). Positions follow the
talker's own `get_rope_index` over the same text.

Columns: the thinker's (`input_ids` of a chat prompt ending in the assistant header, then the reply;
`attention_mask`; `labels` on the reply only; media inputs), plus `codec_ids` (rows, frames, codebooks): each row's
speech codes, the last frame's first code the codec end token, -100 for absent codes; and `speaker_token_ids`
(rows,): the speaker's codec token (`config.talker_config.speaker_id[name]`). The user part is padded to the rows'
width (no host read of its length per step).
"""

from __future__ import annotations

import torch

from .step import ReleasedStep, StepOutput, register_step, token_loss


@register_step
class Qwen3OmniMoeStep(ReleasedStep):
    released_class = "Qwen3OmniMoeForConditionalGeneration"
    heads = {"text": "thinker.lm_head", "codec": "talker.codec_head"}
    counts = {"codec_ids": "num_codec_items"}

    def forward(self, input_ids=None, attention_mask=None, labels=None, codec_ids=None, speaker_token_ids=None,
                input_features=None, feature_attention_mask=None, audio_feature_lengths=None, pixel_values=None,
                image_grid_thw=None, pixel_values_videos=None, video_grid_thw=None, use_audio_in_video=None,
                video_second_per_grid=None, mm_encoder_outputs=None, num_items_in_batch=None, num_codec_items=None,
                **kwargs):
        media = {k: v for k, v in dict(
            input_features=input_features, feature_attention_mask=feature_attention_mask,
            audio_feature_lengths=audio_feature_lengths, pixel_values=pixel_values, image_grid_thw=image_grid_thw,
            pixel_values_videos=pixel_values_videos, video_grid_thw=video_grid_thw,
            use_audio_in_video=use_audio_in_video, video_second_per_grid=video_second_per_grid,
            mm_encoder_outputs=mm_encoder_outputs).items() if v is not None}
        speaking = codec_ids is not None
        if speaking:
            if not getattr(self.released, "has_talker", False):
                raise ValueError("Qwen3-Omni: codec_ids given but the model has no talker (enable_audio_output is "
                                 "false)")
            if labels is None or speaker_token_ids is None:
                raise ValueError("Qwen3-Omni: codec_ids need the reply they speak (labels on the reply tokens) and "
                                 "speaker_token_ids (each row's config.talker_config.speaker_id)")
        kwargs.setdefault("use_cache", False)
        out = self.released.thinker(input_ids=input_ids, attention_mask=attention_mask, labels=labels,
                                    output_hidden_states=speaking, num_items_in_batch=num_items_in_batch,
                                    **media, **kwargs)
        losses = {} if out.loss is None else {"text": out.loss}
        if speaking:
            layer = self.released.config.talker_config.accept_hidden_layer
            losses["codec"] = codec_loss(self.released, out.hidden_states[0], out.hidden_states[layer], input_ids,
                                         attention_mask, labels, codec_ids, speaker_token_ids, media,
                                         num_codec_items)
        return StepOutput(loss=sum(losses.values()) if losses else None, logits=out.logits, losses=losses)


def codec_loss(released, embeds, states, input_ids, attention_mask, labels, codec_ids, speaker_token_ids, media,
               count):
    config, talker = released.config, released.talker
    device = embeds.device
    rows, width = input_ids.shape
    frames, groups = codec_ids.shape[1], codec_ids.shape[2]
    mask = (attention_mask if attention_mask is not None else torch.ones_like(input_ids)).to(device)
    ids = input_ids.to(device)
    column = torch.arange(width, device=device).expand(rows, -1)
    answered = labels.to(device) != -100
    reply = answered.int().argmax(-1, keepdim=True)  # the reply's first column
    replied = answered.sum(-1, keepdim=True)
    header = reply - 3  # <|im_start|>assistant\n

    # the user turns: every token whose last <|im_start|> opens a user turn, left-padded to the rows' width
    opened = torch.cummax(torch.where(ids == config.im_start_token_id, column, -1), -1).values.clamp_min(0)
    role = ids.gather(1, (opened + 1).clamp_max(width - 1))
    user = (role == config.user_token_id) & mask.bool() & (column < header)
    order = torch.where(user, width + column, column).argsort(-1)  # user tokens last, in order
    user_mask = torch.arange(width, device=device)[None] >= (width - user.sum(-1, keepdim=True))
    thinker = config.thinker_config
    media_tokens = torch.tensor([thinker.audio_token_id, thinker.image_token_id, thinker.video_token_id],
                                device=device)
    multimodal = torch.isin(ids, media_tokens)[..., None]
    text_states = talker.text_projection(embeds)
    user_part = torch.where(multimodal, talker.hidden_projection(states).to(text_states.dtype), text_states)
    user_part = user_part.gather(1, order[..., None].expand(-1, -1, user_part.shape[-1]))
    user_part = user_part * user_mask[..., None].to(user_part.dtype)
    user_ids = torch.where(user_mask, ids.gather(1, order), config.tts_pad_token_id)

    # the assistant's prefix (9 positions) and the reply's trailing text, as `generate` builds them
    specials = torch.tensor([config.tts_bos_token_id, config.tts_eos_token_id, config.tts_pad_token_id],
                            device=device)
    tts_bos, tts_eos, tts_pad = talker.text_projection(released.thinker.get_input_embeddings()(specials)).to(
        text_states.dtype)
    at = lambda offset: text_states.gather(  # noqa: E731  (each row's projected embedding at header + offset)
        1, (header + offset).clamp(0, width - 1)[..., None].expand(-1, -1, text_states.shape[-1]))
    prefix_text = torch.cat([at(0), at(1), at(2), tts_pad.expand(rows, 4, -1), tts_bos.expand(rows, 1, -1), at(3)],
                            1)
    t = config.talker_config
    codec_tokens = torch.tensor([t.codec_nothink_id, t.codec_think_bos_id, t.codec_think_eos_id, 0, t.codec_pad_id,
                                 t.codec_bos_id], device=device).expand(rows, -1).clone()
    codec_tokens[:, 3] = speaker_token_ids.to(device)
    code_embed = talker.get_input_embeddings()
    prefix_codec = torch.cat([torch.zeros_like(prefix_text[:, :3]), code_embed(codec_tokens).to(prefix_text.dtype)],
                             1)
    steps = torch.arange(frames, device=device)[None]  # frame k's input: frame k-1's codes + trailing[k-1]
    trailing = text_states.gather(1, (reply + 1 + steps).clamp(max=width - 1)[..., None].expand(
        -1, -1, text_states.shape[-1]))
    trailing = torch.where((steps == replied - 2)[..., None], tts_eos, trailing)  # the reply's last token unfed
    trailing = torch.where((steps > replied - 2)[..., None], tts_pad, trailing)

    codes = codec_ids.to(device)
    fed = codes[:, :-1].clamp(min=0)  # frames 0 .. K-2 feed positions after the prefix
    residual_embed = talker.code_predictor.get_input_embeddings()
    frame_inputs = code_embed(fed[..., 0]) + sum(residual_embed[g - 1](fed[..., g]) for g in range(1, groups))
    frame_inputs = frame_inputs.to(trailing.dtype) + trailing[:, :frames - 1]
    sequence = torch.cat([user_part, prefix_text + prefix_codec, frame_inputs], 1)
    talker_mask = torch.cat([user_mask.long(), torch.ones(rows, 9 + frames - 1, dtype=torch.long, device=device)],
                            1)
    talker_ids = torch.cat([user_ids, torch.full((rows, 9 + frames - 1), config.tts_pad_token_id, device=device)],
                           1)
    positions = talker_positions(talker, talker_ids, talker_mask, media)
    hidden = talker.model(inputs_embeds=sequence, attention_mask=talker_mask, position_ids=positions,
                          use_cache=False).last_hidden_state
    predicting = hidden[:, width + 8:]  # the states that predict frames 0 .. K-1's first codes
    first = talker.codec_head(predicting)

    # the code predictor: per frame, [its predicting state][code 0][code 1] .. [code G-2] -> codes 1 .. G-1
    chain = [predicting, code_embed(codes[..., 0].clamp(min=0)).to(predicting.dtype)]
    chain += [residual_embed[g - 1](codes[..., g].clamp(min=0)).to(predicting.dtype) for g in range(1, groups - 1)]
    predictor = talker.code_predictor
    inner = predictor.model(inputs_embeds=torch.stack(chain, 2).flatten(0, 1), use_cache=False).last_hidden_state
    residual = torch.stack([predictor.lm_head[g - 1](inner[:, g]) for g in range(1, groups)], 1)
    summed = token_loss(first, codes[..., 0], 1.0) + token_loss(residual, codes[..., 1:].flatten(0, 1), 1.0)
    if count is None:  # a mean over every codebook's targets of the batch
        count = (codes != -100).sum()
    return summed / (count.to(device) if torch.is_tensor(count) else count)


def talker_positions(talker, ids, mask, media):
    """Text positions from the mask and, with media, the talker's `get_rope_index` over the same text (continuing
    sequentially past the prompt, as `generate`'s decoding steps do): (4, rows, positions)."""
    text = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)
    lengths = media.get("audio_feature_lengths")
    if media.get("feature_attention_mask") is not None:
        lengths = media["feature_attention_mask"].sum(-1)
    grids = [media.get("image_grid_thw"), media.get("video_grid_thw")]
    if lengths is not None or any(g is not None and g.numel() > 0 for g in grids):
        vision, _ = talker.get_rope_index(ids, grids[0], grids[1], mask, media.get("use_audio_in_video") or False,
                                          lengths, media.get("video_second_per_grid"))
    else:
        vision = text[None].expand(3, -1, -1)
    return torch.cat([text[None], vision], 0)
