"""Qwen2.5-Omni's training step: the thinker's text loss and the talker's codec loss, trained jointly.

`Qwen2_5OmniForConditionalGeneration` implements no `forward`, its talker takes no `labels`, and the talker's
inputs (the thinker's prompt and reply states projected into it, the codec pad / bos embeddings) are built only
inside `generate`. This step builds them from the release's own parts, laid out position for position as
`generate` lays them out, so that the talker learns to predict what it is later asked for:

    thinker:  [prompt][reply r0 .. rR-1]                       labels on the reply: the text loss
    talker:   [prompt][spk][r0 + bos][r1 + c0] .. [rR-2 + cR-3][eos + cR-2][pad + cR-1] ..
    targets:              c0          c1            cR-2          cR-1        cR ..

A talker position holds the thinker's last hidden state plus its input embedding (image / audio / video
positions' embeddings zeroed, as `generate` zeroes them), `spk` the speaker's text token (`spk_dict.pt`'s
`bos_token`), then the codec stream: codec pad and bos, then each target code, on top of the reply tokens after the
first (the reply's last token, its end-of-turn, is never fed: `generate` stops on it), the text eos and then text
pad embeddings. Positions follow the talker's own `get_rope_index` over the same text, as `generate`'s prefill and
its decoding steps number them. The talker's loss flows into the thinker through those states (joint training).

Columns: the thinker's (`input_ids`, `attention_mask`, `labels` on the reply only, contiguous, media inputs) plus
`codec_ids` (rows, codes): each row's speech codes (the release's speech tokenizer's output for real data, ending in
the codec end token; -100 after it and for rows without speech), and `speaker_token_ids` (rows,): the speaker's
`bos_token`. Without `codec_ids` only the text loss is computed.
"""

from __future__ import annotations

import os

import torch

from .step import register_step, token_loss
from .thinker_talker import ThinkerTalkerStep

@register_step
class Qwen2_5OmniStep(ThinkerTalkerStep):
    released_class = "Qwen2_5OmniForConditionalGeneration"
    family = "Qwen2.5-Omni"
    speaker = "speaker's bos_token, as generate(speaker=...) reads it"

    def speech_loss(self, states, input_ids, attention_mask, labels, codec_ids, speaker_token_ids, media, count):
        states = states[-1] + states[0].masked_fill(media_positions(self.released, input_ids)[..., None], 0)
        logits, targets = talker_logits(self.released, states, input_ids, attention_mask, labels, codec_ids,
                                        speaker_token_ids, media)
        return token_loss(logits, targets, count)

    def save_files(self, folder: str) -> None:
        """`spk_dict.pt`: the speakers (`from_pretrained` refuses a folder without it; `save_pretrained` omits it)."""
        torch.save(dict(getattr(self.released, "speaker_map", {})), os.path.join(folder, "spk_dict.pt"))


def media_positions(released, input_ids: torch.Tensor) -> torch.Tensor:
    """The audio / image / video placeholder positions, whose embeddings `generate` zeroes for the talker."""
    config = released.config.thinker_config
    ids = (config.audio_token_index, config.image_token_index, config.video_token_index)
    return torch.isin(input_ids, torch.tensor(ids, device=input_ids.device))


def talker_logits(released, states, input_ids, attention_mask, labels, codec_ids, speaker_token_ids, media):
    """The talker's logits over the layout in the module docstring, and their targets (-100 where none)."""
    talker = released.talker
    device = states.device
    rows, width = input_ids.shape
    codes = codec_ids.shape[1]
    mask = attention_mask if attention_mask is not None else torch.ones_like(input_ids)
    answered = labels.to(device) != -100
    start = answered.int().argmax(-1, keepdim=True)  # the reply's first column (rows, 1)
    end = start + answered.sum(-1, keepdim=True)  # one past its last
    column = torch.arange(width + codes, device=device).expand(rows, -1)  # talker columns (rows, width + codes)

    source = torch.where(column < start, column, column - 1).clamp(0, width - 1)
    ends = torch.tensor([talker.text_eos_token, talker.text_pad_token], device=device)
    words = released.thinker.get_input_embeddings()(torch.cat([speaker_token_ids.to(device), ends]))  # one call: a
    words = words.to(states.dtype)  # sharded module's embeddings gather once
    hidden = states.gather(1, source[..., None].expand(rows, -1, states.shape[-1]))
    hidden = torch.where((column == start)[..., None], words[:rows, None], hidden)
    hidden = torch.where((column == end)[..., None], words[rows], hidden)
    hidden = torch.where((column > end)[..., None], words[rows + 1], hidden)

    codec = codec_ids.to(device)
    fed = codec.clamp(min=0).gather(1, (column - start - 2).clamp(0, codes - 1))
    fed = torch.where(column == start, talker.codec_pad_token, torch.where(column == start + 1, talker.codec_bos_token,
                                                                             fed))
    hidden = hidden + talker.get_input_embeddings()(fed) * (column >= start)[..., None].to(hidden.dtype)
    index = column - start - 1
    targets = codec.gather(1, index.clamp(0, codes - 1))
    targets = torch.where((index >= 0) & (index < codes), targets, -100)

    inside = column.clamp(max=width - 1)
    talker_mask = torch.where(column < start, mask.to(device).gather(1, inside), 1)
    text_ids = torch.where(column < start, input_ids.to(device).gather(1, inside),
                           speaker_token_ids.to(device)[:, None])
    text_ids = torch.where(column == start + 1, input_ids.to(device).gather(1, start), text_ids)
    lengths = media.get("audio_feature_lengths")
    if media.get("feature_attention_mask") is not None:
        lengths = media["feature_attention_mask"].sum(-1)
    positions, _ = talker.get_rope_index(text_ids, media.get("image_grid_thw"), media.get("video_grid_thw"),
                                         talker_mask, media.get("use_audio_in_video", False), lengths,
                                         media.get("video_second_per_grid"))
    out = talker(inputs_embeds=hidden, attention_mask=talker_mask, position_ids=positions, use_cache=False)
    return out.logits, targets
