"""Inputs to an entry point wrong on one rank, at 2 ranks started as plain processes (RANK / WORLD_SIZE /
MASTER_ADDR, no launcher): rank 1 passes pixels without their mask (MODE `partial`) or a list for them (MODE
`not_a_tensor`), or no pixels to an entry point with ragged outputs (MODE `ragged`: no dummy can be built; rank 0
has pixels), or pixels on every rank to it (MODE `ragged_everywhere`: runs); rank 1's forward passes the mask on as None
unlike its argument (MODE `not_as_planned`), or rank 1 calls the model with an argument its forward does not take
(MODE `unbound`), or passes it on as None inside an accumulation window agreed up front (MODE
`window_not_as_planned`: both raise at the next window's agreement). Each rank writes what it raised to
OUT_DIR/rank<r>.txt and exits 1. MODE `two_towers`: two replicated towers whose entry points take `forward`'s
arguments, rank 1 without sound at the second of 3 steps; each rank writes how many all-gathers of host metadata
each forward made and a digest of its towers' gradients (DDP-reduced: equal on both ranks), then, on its own line,
a non-persistent buffer built as the rank's number (rank 0's after wrapping) and set to 5 + rank after it (kept
through the forwards: only state buffers are broadcast before each), and a BatchNorm statistic set to 7 on rank 1
after wrapping (rank 0's again after a forward).

Usage: mp_exchange.py MODE OUT_DIR"""

import os
import sys

import torch
from accelerate import Accelerator
from transformers import ResNetConfig, ResNetModel

from hf_omni import OmniModel, OmniPlugin, offline_encoder
from launching import end_distributed


class Tower(OmniModel):
    @offline_encoder(module="vision", inputs=["pixel_values", "mask"], output="features")
    def encode(self, pixel_values, mask):
        return self.vision(pixel_values=pixel_values * mask).pooler_output.flatten(1)

    def forward(self, pixel_values=None, mask=None):
        feats = self.encode(pixel_values, mask=mask)
        return {"loss": feats.square().mean()}


class DeviatingTower(Tower):
    def forward(self, pixel_values=None, mask=None):
        feats = self.encode(pixel_values, mask=mask if os.environ["RANK"] == "0" else None)
        return {"loss": feats.square().mean()}


class RaggedTower(Tower):
    @offline_encoder(module="vision", inputs=["pixel_values", "mask"], output="features", ragged="tuple")
    def encode(self, pixel_values, mask):
        return tuple(self.vision(pixel_values=pixel_values * mask).pooler_output.flatten(1))

    def forward(self, pixel_values=None, mask=None):
        feats = self.encode(pixel_values, mask=mask)
        return {"loss": torch.cat(feats).square().mean()}


class TwoTowers(Tower):
    @offline_encoder(module="audio", inputs=["sound"], output="audio_features")
    def encode_audio(self, sound):
        return self.audio(pixel_values=sound).pooler_output.flatten(1)

    def forward(self, pixel_values=None, mask=None, sound=None):
        feats = [self.encode(pixel_values, mask=mask), self.encode_audio(sound)]
        return {"loss": torch.cat(feats).square().mean()}


def two_towers(rank: int, tower) -> str:
    """Gathers per forward, then the gradients' sums, as one line."""
    import copy

    import hf_omni.offline.exchange

    plugin = OmniPlugin(modules={"vision": {"parallel": "ddp"}, "audio": {"parallel": "ddp"}},
                        defaults={"learning_rate": 1e-3})
    tower.register_buffer("derived", torch.full((2,), float(rank)), persistent=False)
    model, _, _ = plugin.prepare(Accelerator(cpu=True), TwoTowers.from_modules(
        {"vision": tower, "audio": copy.deepcopy(tower)}), num_training_steps=3)
    wrapped = model.vision.derived.tolist()
    model.vision.derived.fill_(5 + rank)
    statistic = model.vision.embedder.embedder.normalization.running_var
    if rank == 1:
        statistic.fill_(7.0)
    counted, gathers, original = [0], [], hf_omni.offline.exchange.all_gather_host

    def all_gather_host(rows, group):
        counted[0] += 1
        return original(rows, group)

    hf_omni.offline.exchange.all_gather_host = all_gather_host  # where the exchange looks it up
    for step in range(3):
        counted[0] = 0
        sound = torch.rand(2, 1, 4, 4)  # drawn on every rank: both ranks' data stay alike
        sound = None if rank == 1 and step == 1 else sound
        model(pixel_values=torch.rand(2, 1, 4, 4), mask=torch.ones(2, 1, 1, 1, dtype=torch.bool),
              sound=sound)["loss"].backward()
        gathers.append(counted[0])
    grads = [round(sum(p.grad.sum().item() for p in m.parameters()), 6) for m in (model.vision, model.audio)]
    return (f"gathers {gathers} grads {grads} statistic {round(statistic.sum().item(), 6)}\n"
            f"derived {wrapped} then {model.vision.derived.tolist()}")


def window_run(rank: int, plugin, vision, out_dir: str, save: bool = False) -> None:
    """Two windows of two micro-steps agreed up front (`plugin.agree_window`); rank 1's forward passes its mask on as
    None in the first window, unlike what the window agreed: rank 1 keeps the error and runs the dummy, the step
    completes on both ranks, and both raise the same error at the second window's agreement (`save`: at a
    checkpoint of the first step instead, before anything is written)."""
    plugin.output_dir = os.path.join(out_dir, "run")
    model, optimizer, _ = plugin.prepare(Accelerator(cpu=True), DeviatingTower.from_modules({"vision": vision}),
                                         num_training_steps=2)
    batch = {"pixel_values": torch.rand(2, 1, 4, 4), "mask": torch.ones(2, 1, 1, 1, dtype=torch.bool)}
    outcome, steps = "no error", 0
    try:
        for _ in range(2):
            plugin.agree_window([batch, batch])
            with plugin.no_sync():
                model(**batch)["loss"].backward()
            model(**batch)["loss"].backward()
            optimizer.step(), optimizer.zero_grad()
            steps += 1
            if save:
                plugin.save_state(os.path.join(out_dir, "checkpoint"))
        plugin.close()
    except Exception as err:  # noqa: BLE001 - the test reads what each rank raised
        outcome = f"{type(err).__name__}: {err}"
    with open(os.path.join(out_dir, f"rank{rank}.txt"), "w") as f:
        f.write(f"{outcome} [after {steps} steps]")
    end_distributed(0 if outcome == "no error" else 1)


def main(mode: str, out_dir: str):
    rank = int(os.environ["RANK"])
    torch.manual_seed(0)
    vision = ResNetModel(ResNetConfig(num_channels=1, embedding_size=8, hidden_sizes=[16], depths=[1],
                                      layer_type="basic"))
    plugin = OmniPlugin(modules={"vision": {"parallel": "ddp"}}, defaults={"learning_rate": 1e-3})
    if mode == "two_towers":
        with open(os.path.join(out_dir, f"rank{rank}.txt"), "w") as f:
            f.write(two_towers(rank, vision))
        end_distributed(0)
    if mode.startswith("window_"):
        window_run(rank, plugin, vision, out_dir, save=mode == "window_then_save")
    cls = RaggedTower if mode.startswith("ragged") else DeviatingTower if mode == "not_as_planned" else Tower
    model, _, _ = plugin.prepare(Accelerator(cpu=True), cls.from_modules({"vision": vision}), num_training_steps=2)
    pixels, mask = torch.rand(2, 1, 4, 4), torch.ones(2, 1, 1, 1, dtype=torch.bool)
    if rank == 1 and mode == "ragged":
        pixels, mask = None, None
    elif rank == 1 and mode in ("partial", "not_a_tensor"):
        mask = None if mode == "partial" else [[1.0]] * 2
    extra = {"sound": pixels} if rank == 1 and mode == "unbound" else {}
    try:
        model(pixel_values=pixels, mask=mask, **extra)["loss"].backward()
        outcome = "no error"
    except Exception as err:  # noqa: BLE001 - the test reads what each rank raised
        outcome = f"{type(err).__name__}: {err}"
    with open(os.path.join(out_dir, f"rank{rank}.txt"), "w") as f:
        f.write(outcome)
    end_distributed(0 if outcome == "no error" else 1)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
