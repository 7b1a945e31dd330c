"""The training step the thinker-talker releases share (Qwen2.5-Omni, Qwen3-Omni-MoE): the thinker's own forward
with its text loss from `labels`, then the family's codec loss from the thinker's states (`speech_loss`)."""

from __future__ import annotations

from .step import ReleasedStep, StepOutput


class ThinkerTalkerStep(ReleasedStep):
    family = ""  # for messages
    speaker = ""  # what `speaker_token_ids` holds, for messages
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
            self.check_talker(labels, speaker_token_ids)
        kwargs.setdefault("use_cache", False)
        out = self.released.thinker(input_ids=input_ids, attention_mask=attention_mask, labels=labels,
                                    output_hidden_states=speaking, num_items_in_batch=num_items_in_batch,
                                    **media, **kwargs)
        losses = {} if out.loss is None else {"text": out.loss}
        if speaking:
            losses["codec"] = self.speech_loss(out.hidden_states, input_ids, attention_mask, labels, codec_ids,
                                               speaker_token_ids, media, num_codec_items)
        return StepOutput(loss=sum(losses.values()) if losses else None, logits=out.logits, losses=losses)

    def check_talker(self, labels, speaker_token_ids) -> None:
        if not getattr(self.released, "has_talker", False):
            raise ValueError(f"{self.family}: codec_ids given but the model has no talker (config.enable_audio_output "
                             "is false): call enable_talker() before adopting it, or leave codec_ids out")
        if labels is None or speaker_token_ids is None:
            raise ValueError(f"{self.family}: codec_ids need the reply they speak (labels on the reply tokens) and "
                             f"speaker_token_ids (each row's {self.speaker})")

    def speech_loss(self, states, input_ids, attention_mask, labels, codec_ids, speaker_token_ids, media, count):
        raise NotImplementedError  # pragma: no cover - each family's
