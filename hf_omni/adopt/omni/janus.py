"""Janus' training step: understanding (its text loss) and image generation (its image-token loss) from mixed
batches, in one pass of the language model.

`JanusForConditionalGeneration`'s `labels` give the text loss only; its image generation path exists only inside
`generate(generation_mode="image")`. This step composes that path from the release's own parts, as `generate` lays
it out: the image to draw is tokenised by the (frozen) VQ model, `vqmodel.encode(...).image_tokens`; the prompt's
text embeddings (the prompt ends in the begin-of-image token) are followed by
`prepare_embeddings_for_image_generation` of the image tokens but the last; the language model's last states at the
begin-of-image token and at each fed image token, through `generation_head`, predict the image tokens in order
(cross-entropy). Understanding rows are the release's own: text embeddings with the vision tower's aligned features
scattered at the image tokens, `lm_head`, `labels`.

Both kinds of rows go through the language model together (left-padded to one width, positions counted from the
attention mask as `generate` counts them), so each step gathers a sharded language model once.

Columns: understanding rows as the release takes them (`input_ids`, `attention_mask`, `labels`, `pixel_values`);
generation rows as `generation_input_ids` / `generation_attention_mask` (the prompt, left-padded, ending in the
begin-of-image token) and `generation_pixel_values` (the image to draw, as the image processor gives it) or its VQ
tokens `generation_image_ids` (rows, image tokens), encoded ahead of time by the frozen VQ model.
"""

from __future__ import annotations

import torch

from .step import ReleasedStep, StepOutput, register_step, token_loss


@register_step
class JanusStep(ReleasedStep):
    released_class = "JanusForConditionalGeneration"
    heads = {"text": "lm_head", "image": "model.generation_head"}
    counts = {"generation_pixel_values": "num_image_items", "generation_image_ids": "num_image_items"}

    def targets_in(self, column: str, value: torch.Tensor) -> torch.Tensor:
        if column == "generation_pixel_values":  # every image to draw: its image tokens are targets
            return torch.tensor(value.shape[0] * self.image_tokens, device=value.device)
        return super().targets_in(column, value)

    @property
    def image_tokens(self) -> int:
        return self.released.model.vision_model.config.num_image_tokens

    def forward(self, input_ids=None, pixel_values=None, attention_mask=None, labels=None,
                generation_input_ids=None, generation_attention_mask=None, generation_pixel_values=None,
                generation_image_ids=None, mm_encoder_outputs=None, num_items_in_batch=None, num_image_items=None,
                **kwargs):
        released = self.released
        model = released.model
        if generation_pixel_values is not None and generation_image_ids is not None:
            raise ValueError("Janus: give the images to draw as generation_pixel_values or as their VQ tokens "
                             "(generation_image_ids), not both")
        reading = input_ids is not None
        drawing = generation_pixel_values is not None or generation_image_ids is not None
        if not reading and not drawing:
            raise ValueError("Janus: a batch needs understanding rows (input_ids) or generation rows "
                             "(generation_input_ids and generation_pixel_values)")
        if drawing and generation_input_ids is None:
            raise ValueError("Janus: the images to draw need their prompts (generation_input_ids, ending in the "
                             "begin-of-image token)")
        ids = [t for t in (input_ids, generation_input_ids) if t is not None]
        width = max(t.shape[1] for t in ids)
        words = model.get_input_embeddings()(torch.cat([left_pad(t, width, 0) for t in ids]))  # one call
        rows = input_ids.shape[0] if reading else 0
        pieces = []
        if reading:
            embeds = read_embeddings(released, words[:rows, width - input_ids.shape[1]:], input_ids, pixel_values,
                                     mm_encoder_outputs)
            pieces.append((embeds, attention_mask if attention_mask is not None else torch.ones_like(input_ids)))
        if drawing:
            tokens = generation_image_ids
            if tokens is None:
                with torch.no_grad():  # the VQ model is frozen; its tokens are integers
                    tokens = model.vqmodel.encode(generation_pixel_values).image_tokens.view(
                        generation_pixel_values.shape[0], -1)
            prompt = words[rows:, width - generation_input_ids.shape[1]:]
            drawn = released.prepare_embeddings_for_image_generation(tokens[:, :-1]).to(prompt.dtype)
            mask = generation_attention_mask if generation_attention_mask is not None \
                else torch.ones_like(generation_input_ids)
            pieces.append((torch.cat([prompt, drawn], 1), torch.cat([mask, torch.ones_like(tokens[:, 1:])], 1)))
        span = max(p[0].shape[1] for p in pieces)
        embeds = torch.cat([left_pad(e, span, 0.0) for e, _ in pieces])
        mask = torch.cat([left_pad(m, span, 0) for _, m in pieces])
        positions = (mask.long().cumsum(-1) - 1).masked_fill(mask == 0, 1)  # as generate counts them
        kwargs.setdefault("use_cache", False)
        hidden = model.language_model(inputs_embeds=embeds, attention_mask=mask, position_ids=positions,
                                      **kwargs).last_hidden_state
        losses, logits = {}, None
        if reading:  # the understanding rows at their own width (the batch's columns)
            logits = released.lm_head(hidden[:rows, span - input_ids.shape[1]:])
            if labels is not None:
                losses["text"] = released.loss_function(logits=logits, labels=labels,
                                                        vocab_size=released.config.text_config.vocab_size,
                                                        num_items_in_batch=num_items_in_batch)
        if drawing:
            scores = model.generation_head(hidden[rows:, span - tokens.shape[1]:])
            losses["image"] = token_loss(scores, tokens, num_image_items)
        return StepOutput(loss=sum(losses.values()) if losses else None, logits=logits, losses=losses)


def read_embeddings(released, embeds, input_ids, pixel_values, mm_encoder_outputs):
    """Understanding rows' embeddings as the release's own forward makes them: the vision tower's aligned
    features (or their cached outputs) scattered at the image tokens."""
    features = (mm_encoder_outputs or {}).get("image")
    if features is None and pixel_values is not None:
        features = released.model.get_image_features(pixel_values, return_dict=True)
    if features is None:
        return embeds
    flat = features.pooler_output.reshape(-1, embeds.shape[-1]).to(embeds.dtype)
    return embeds.masked_scatter((input_ids == released.config.image_token_id)[..., None], flat)


def left_pad(tensor: torch.Tensor, width: int, value) -> torch.Tensor:
    """(rows, n, ...) -> (rows, width, ...), `value` before the columns."""
    missing = width - tensor.shape[1]
    if missing == 0:
        return tensor
    pad = torch.full((tensor.shape[0], missing, *tensor.shape[2:]), value, dtype=tensor.dtype, device=tensor.device)
    return torch.cat([pad, tensor], 1)
