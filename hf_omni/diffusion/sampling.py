"""`SampleImagesCallback`: sample images logged while training. Every N optimizer steps (and at the end of
training) the model's live pipeline (`OmniModel.to_pipeline`) samples fixed prompts from a fixed seed, and the images
go to the run's trackers (TensorBoard: `tensorboard_dir`; W&B: its run; as `report_to` names them) and to
`<output_dir>/samples/step-<N>/<i>.png`.

Every rank samples (a sharded module's forward is collective); the main process logs and writes. Sampling runs in
eval mode under `torch.random.fork_rng`, so training's random state (dropout, noise, a resumed run's stream) is the
one it would be without the callback."""

from __future__ import annotations

import os

import numpy as np
import torch
from transformers import TrainerCallback

TAG = "samples"


def tensorboard_dir(args) -> str:
    """Where the images go: `TENSORBOARD_LOGGING_DIR` (where Trainer's TensorBoard callback writes, when set), else
    `<output_dir>/runs/samples`, a run of its own beside Trainer's under the folder TensorBoard is pointed at."""
    return os.path.expanduser(os.getenv("TENSORBOARD_LOGGING_DIR") or os.path.join(args.output_dir, "runs", TAG))


class SampleImagesCallback(TrainerCallback):
    """Every `every_n_steps` optimizer steps and at the end, the model's pipeline samples `prompts` from `seed`
    (`pipeline_kwargs` go to the pipeline's call; 2 inference steps unless given): logged to the trackers and
    written to `<output_dir>/samples/step-<N>/`."""

    def __init__(self, prompts: list[str], every_n_steps: int, seed: int = 0, **pipeline_kwargs):
        if not prompts or every_n_steps < 1:
            raise ValueError("SampleImagesCallback: give at least one prompt and every_n_steps >= 1")
        self.prompts, self.every_n_steps, self.seed = list(prompts), every_n_steps, seed
        self.pipeline_kwargs = {"num_inference_steps": 2, **pipeline_kwargs}
        self.last_step = -1

    def sample(self, model) -> np.ndarray:
        """(prompts, H, W, channels) floats in [0, 1]: the model's pipeline as it is now, from the fixed seed."""
        was_training = model.training
        model.eval()
        try:
            with torch.random.fork_rng(devices=[]):
                generator = torch.Generator().manual_seed(self.seed)
                out = model.to_pipeline()(self.prompts, generator=generator, output_type="np", **self.pipeline_kwargs)
        finally:
            model.train(was_training)
        return np.asarray(out.images)

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        offline = list(getattr(args, "offline_modules", None) or [])
        if offline:  # refused before the first step, not at step N
            raise ValueError(f"SampleImagesCallback: offline_modules {offline} are never materialised while training, "
                             "and a pipeline runs every component")

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if state.global_step % self.every_n_steps == 0:
            self.log_samples(args, state, model)

    def on_train_end(self, args, state, control, model=None, **kwargs):
        self.log_samples(args, state, model)

    def log_samples(self, args, state, model) -> None:
        if state.global_step == self.last_step:
            return
        self.last_step = state.global_step
        images = self.sample(model)
        if not state.is_world_process_zero:
            return
        uint8 = (images * 255).round().clip(0, 255).astype(np.uint8)
        folder = os.path.join(args.output_dir, TAG, f"step-{state.global_step}")
        os.makedirs(folder, exist_ok=True)
        from PIL import Image

        for i, image in enumerate(uint8):  # one channel (grey pixel-space pipelines): PIL takes it as (H, W)
            Image.fromarray(image[..., 0] if image.shape[-1] == 1 else image).save(os.path.join(folder, f"{i}.png"))
        trackers = args.report_to or []
        if "tensorboard" in trackers:
            from torch.utils.tensorboard import SummaryWriter

            with SummaryWriter(tensorboard_dir(args)) as writer:
                writer.add_images(TAG, uint8, state.global_step, dataformats="NHWC")
        if "wandb" in trackers:
            import wandb

            if wandb.run is not None:
                wandb.log({TAG: [wandb.Image(image, caption=p) for image, p in zip(uint8, self.prompts)],
                           "train/global_step": state.global_step})  # the step axis Trainer's W&B callback uses
