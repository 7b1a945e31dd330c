"""Caption the held-out digits with an exported captioner, eagerly, in one process: the LLM's own `generate`
(greedy) after the image prefix. Prints the accuracy, the same figure as examples/train.py's.

    python examples/caption.py runs/digits [--device cpu] [--merge-lora]
"""

import argparse

import torch

from hf_omni.testing.digits import Captioner, load_splits


@torch.no_grad()
def generate_captions(model: Captioner, pixel_values: torch.Tensor, length: int) -> torch.Tensor:
    """[BOS] + `length - 1` greedy tokens after the projected image patches, by `llm.generate`."""
    tokenizer = model.processors["llm"]
    device = next(model.llm.parameters()).device
    prefix = model.projector(model.encode_image(pixel_values.to(next(model.vision.parameters()).device)).to(device))
    bos = torch.full((len(pixel_values), 1), tokenizer.bos_token_id, device=device)
    embeds = torch.cat([prefix.to(model.llm.dtype), model.llm.get_input_embeddings()(bos)], dim=1)
    new = model.llm.generate(inputs_embeds=embeds, attention_mask=torch.ones(embeds.shape[:2], device=device),
                             max_new_tokens=length - 1, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    padded = torch.full((len(new), length - 1), tokenizer.pad_token_id, device=device)  # stopped early at [EOS]
    padded[:, :new.shape[1]] = new
    return torch.cat([bos, padded], dim=1)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dir")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--merge-lora", action="store_true")
    args = parser.parse_args()
    model = Captioner.from_pretrained(args.run_dir, device_map=args.device, merge_lora=args.merge_lora)
    _, held_out = load_splits(model.processors["llm"])
    reference = held_out.input_ids
    ids = torch.cat([generate_captions(model, held_out.pixels[i:i + 512], reference.shape[1]).cpu()
                     for i in range(0, len(held_out), 512)])
    accuracy = (ids == reference).all(dim=1).float().mean().item()
    tokenizer = model.processors["llm"]
    for i in range(3):
        print(f"digit {held_out.targets[i].item()}: {tokenizer.decode(ids[i], skip_special_tokens=True)!r}")
    print(f"held-out caption accuracy: {accuracy:.1%} ({len(held_out)} images), generated with llm.generate")


if __name__ == "__main__":
    main()
