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

from .step import register_step, token_loss
from .thinker_talker import ThinkerTalkerStep


@register_step
class Qwen3OmniMoeStep(ThinkerTalkerStep):
    released_class = "Qwen3OmniMoeForConditionalGeneration"
    family = "Qwen3-Omni"
    speaker = "config.talker_config.speaker_id"

    def speech_loss(self, states, input_ids, attention_mask, labels, codec_ids, speaker_token_ids, media, count):
        layer = self.released.config.talker_config.accept_hidden_layer
        return codec_loss(self.released, states[0], states[layer], input_ids, attention_mask, labels, codec_ids,
                          speaker_token_ids, media, count)


def codec_loss(released, embeds, states, input_ids, attention_mask, labels, codec_ids, speaker_token_ids, media,
               count):
    """Every codebook's cross-entropy over its codes, summed and divided by `count` (their mean where None)."""
    config, talker = released.config, released.talker
    device = embeds.device
    rows, width = input_ids.shape
    frames = codec_ids.shape[1]
    mask = (attention_mask if attention_mask is not None else torch.ones_like(input_ids)).to(device)
    ids, codes = input_ids.to(device), codec_ids.to(device)
    answered = labels.to(device) != -100
    reply = answered.int().argmax(-1, keepdim=True)  # the reply's first column
    text_states = talker.text_projection(embeds)
    user_part, user_mask, user_ids = user_turns(released, ids, mask, reply - 3, text_states, states)
    prefix, trailing = assistant_parts(released, text_states, reply, answered.sum(-1, keepdim=True),
                                       speaker_token_ids.to(device), frames)
    fed = codes[:, :-1].clamp(min=0)  # frames 0 .. K-2 feed the positions after the prefix
    sequence = torch.cat([user_part, prefix, frame_embeddings(talker, fed).to(trailing.dtype)
                          + trailing[:, :frames - 1]], 1)
    tail = (rows, 9 + frames - 1)
    talker_mask = torch.cat([user_mask.long(), torch.ones(tail, dtype=torch.long, device=device)], 1)
    talker_ids = torch.cat([user_ids, torch.full(tail, config.tts_pad_token_id, device=device)], 1)
    hidden = talker.model(inputs_embeds=sequence, attention_mask=talker_mask, use_cache=False,
                          position_ids=talker_positions(talker, talker_ids, talker_mask, media)).last_hidden_state
    predicting = hidden[:, width + 8:]  # the states that predict frames 0 .. K-1's first codes
    summed = token_loss(talker.codec_head(predicting), codes[..., 0], 1.0) + residual_loss(talker, predicting, codes)
    if count is None:  # a mean over every codebook's targets of the batch
        count = (codes != -100).sum()
    return summed / (count.to(device) if torch.is_tensor(count) else count)


def user_turns(released, ids, mask, header, text_states, states):
    """Every token whose last `<|im_start|>` opens a user turn, in order, left-padded to the rows' width: its
    text's projected embedding, or its audio / image / video position's projected state; their mask and ids."""
    config, talker = released.config, released.talker
    rows, width = ids.shape
    column = torch.arange(width, device=ids.device).expand(rows, -1)
    opened = torch.cummax(torch.where(ids == config.im_start_token_id, column, -1), -1).values.clamp_min(0)
    role = ids.gather(1, (opened + 1).clamp_max(width - 1))
    user = (role == config.user_token_id) & mask.bool() & (column < header)
    order = torch.where(user, width + column, column).argsort(-1)  # user tokens last, in order
    user_mask = column >= (width - user.sum(-1, keepdim=True))
    thinker = config.thinker_config
    media_tokens = torch.tensor([thinker.audio_token_id, thinker.image_token_id, thinker.video_token_id],
                                device=ids.device)
    multimodal = torch.isin(ids, media_tokens)[..., None]
    part = torch.where(multimodal, talker.hidden_projection(states).to(text_states.dtype), text_states)
    part = part.gather(1, order[..., None].expand(-1, -1, part.shape[-1])) * user_mask[..., None].to(part.dtype)
    return part, user_mask, torch.where(user_mask, ids.gather(1, order), config.tts_pad_token_id)


def assistant_parts(released, text_states, reply, replied, speakers, frames):
    """The assistant's 9 prefix positions (its header, tts pad x4 and bos, the reply's first token, over the codec
    think / speaker / pad / bos tokens) and the text fed with each frame (the reply's next token, then tts eos,
    then tts pad), as `generate` builds them."""
    config, talker = released.config, released.talker
    rows, width, size = text_states.shape
    device = text_states.device
    specials = torch.tensor([config.tts_bos_token_id, config.tts_eos_token_id, config.tts_pad_token_id],
                            device=device)
    tts_bos, tts_eos, tts_pad = talker.text_projection(released.thinker.get_input_embeddings()(specials)).to(
        text_states.dtype)
    at = lambda offset: text_states.gather(  # noqa: E731  (each row's projected embedding at its header + offset)
        1, (reply - 3 + offset).clamp(0, width - 1)[..., None].expand(-1, -1, size))
    text = torch.cat([at(0), at(1), at(2), tts_pad.expand(rows, 4, -1), tts_bos.expand(rows, 1, -1), at(3)], 1)
    t = config.talker_config
    tokens = torch.tensor([t.codec_nothink_id, t.codec_think_bos_id, t.codec_think_eos_id, 0, t.codec_pad_id,
                           t.codec_bos_id], device=device).expand(rows, -1).clone()
    tokens[:, 3] = speakers
    codec = torch.cat([torch.zeros_like(text[:, :3]), talker.get_input_embeddings()(tokens).to(text.dtype)], 1)
    steps = torch.arange(frames, device=device)[None]  # frame k's input: frame k-1's codes + trailing[k-1]
    trailing = text_states.gather(1, (reply + 1 + steps).clamp(max=width - 1)[..., None].expand(-1, -1, size))
    trailing = torch.where((steps == replied - 2)[..., None], tts_eos, trailing)  # the reply's last token unfed
    return text + codec, torch.where((steps > replied - 2)[..., None], tts_pad, trailing)


def frame_embeddings(talker, codes):
    """A frame's input: its codes' embeddings summed (the talker's for code 0, the code predictor's for the rest)."""
    residual = talker.code_predictor.get_input_embeddings()
    return talker.get_input_embeddings()(codes[..., 0]) + sum(residual[g - 1](codes[..., g])
                                                               for g in range(1, codes.shape[-1]))


def residual_loss(talker, predicting, codes):
    """The code predictor per frame: [its predicting state][code 0][code 1] .. [code G-2] -> codes 1 .. G-1, each
    from its own head; summed cross-entropy."""
    groups = codes.shape[-1]
    residual = talker.code_predictor.get_input_embeddings()
    chain = [predicting, talker.get_input_embeddings()(codes[..., 0].clamp(min=0)).to(predicting.dtype)]
    chain += [residual[g - 1](codes[..., g].clamp(min=0)).to(predicting.dtype) for g in range(1, groups - 1)]
    predictor = talker.code_predictor
    inner = predictor.model(inputs_embeds=torch.stack(chain, 2).flatten(0, 1), use_cache=False).last_hidden_state
    logits = torch.stack([predictor.lm_head[g - 1](inner[:, g]) for g in range(1, groups)], 1)
    return token_loss(logits, codes[..., 1:].flatten(0, 1), 1.0)


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
