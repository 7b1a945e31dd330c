"""OmniTrainer's Hub pushes: Trainer's hub arguments (`push_to_hub`, `hub_model_id`, `hub_strategy`,
`hub_private_repo`, `hub_token`, `hub_revision`, `hub_always_push`) over per-module repos (`hub.push`).

- `save_model()` by the user, or `push_to_hub()`: the export in `output_dir` is pushed (blocking by default);
- `hub_strategy: every_save | checkpoint | all_checkpoints`: each checkpoint is pushed once its marker is written
  (after the async save's files, when `save_async`), in a background thread, one push at a time (a save while a
  push runs is not pushed, unless `hub_always_push`); `checkpoint` adds the checkpoint as `last-checkpoint/` to the
  composition repo, `all_checkpoints` as `checkpoint-N/`. A checkpoint being pushed is not rotated away.
- A failed background push is logged; if the last push of the run failed, `train()` raises it at its end (the
  checkpoints on disk are untouched: push them with `hf-omni push`).
The token goes to `huggingface_hub` only: Trainer's own push path would pickle the arguments (token included)
into `training_args.bin`; this one writes nothing but the model, its cards and `training_summary.json`.
"""

from __future__ import annotations

import concurrent.futures
import functools
import logging
import os

from ..core.dist import RankFailure, share_failure
from ..hub.push import hub_modules, push_saved

logger = logging.getLogger(__name__)


def check_hub_links(args, model) -> None:
    """Before any compute: the Hub settings a push of `model` could not serve (its composition's answer: every
    `push_to_hub: false` module has a repo to link to; an adopted model or a pipeline is one repo)."""
    model.composition.check_push(args, model)


class BackgroundPush:
    """Trainer's `push_in_progress`: one push at a time in a background thread."""

    def __init__(self):
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._future: concurrent.futures.Future | None = None
        self._folder: str | None = None

    def submit(self, job, folder: str | None = None) -> concurrent.futures.Future:
        if self._executor is None:
            self._executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="hf_omni_push")
        self._folder = folder
        self._future = self._executor.submit(job)
        self._future.add_done_callback(self._log_failure)
        return self._future

    @staticmethod
    def _log_failure(future: concurrent.futures.Future) -> None:
        if future.exception() is not None:
            logger.error("hf_omni: a background push to the Hub failed: %s", future.exception())

    def is_done(self) -> bool:
        return self._future is None or self._future.done()

    def wait_until_done(self) -> None:
        if self._future is not None:
            concurrent.futures.wait([self._future])

    def busy(self) -> tuple[str, ...]:
        """The checkpoint folder a push is reading, while it runs."""
        return (self._folder,) if self._folder and not self.is_done() else ()

    def finish(self, group=None) -> None:
        """Wait for the push in flight (rank 0's); if it failed (the last push of a run), rank 0 raises its error and
        every other rank a `RankFailure` naming it, so no rank goes on to a collective the others never join."""

        self.wait_until_done()
        error = self._future.exception() if self._future is not None else None
        self._future = None  # reported once: a second train() does not raise it again
        try:
            share_failure(error, "the run's last push to the Hub", group)
        except RankFailure:
            if error is not None:
                raise error from None
            raise

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None


class HubPushMixin:
    """The Hub half of `OmniTrainer` (Trainer's push methods, per module)."""

    def _init_hub(self) -> None:
        self.hub_push = BackgroundPush()
        self.push_in_progress = self.hub_push  # Trainer's `_finish_current_push` waits on it
        self._hub_pushed: dict[str, tuple[str, str]] = {}  # frozen modules uploaded once per run

    def _hub_modules(self) -> dict:
        return hub_modules(self.args)

    def _push_job(self, folder: str, message: str, token=None, revision=None, private=None, extra=None):
        args = self.args
        return functools.partial(
            push_saved, folder, self.hub_model_id, layout=args.hub_layout, modules=self._hub_modules(),
            token=token if token is not None else args.hub_token,
            private=private if private is not None else args.hub_private_repo,
            revision=revision if revision is not None else args.hub_revision, commit_message=message,
            extra_folders=extra, pushed=self._hub_pushed)

    def push_to_hub(self, commit_message: str | None = "End of training", blocking: bool = True,
                    token: str | None = None, revision: str | None = None, private: bool | None = None, **kwargs):
        """Save the model to `output_dir` and push it: module repos, then the composition repo. Returns
        `{repo: commit}` (blocking) or a `Future` of it."""
        if kwargs:
            raise ValueError(f"OmniTrainer.push_to_hub: {sorted(kwargs)} are arguments of Trainer's model card; "
                             "hf_omni writes its own per-module cards")
        self.callback_handler.on_push_begin(self.args, self.state, self.control)
        if self.hub_model_id is None:
            self.init_hf_repo(token=token if token is not None else self.args.hub_token, private=private)
            self.push_in_progress = self.hub_push
        self.hub_push.wait_until_done()  # the push in flight reads output_dir: not rewritten under it
        self.save_model(_internal_call=True)
        if not self.is_world_process_zero():
            return None
        job = self._push_job(self.args.output_dir, commit_message or "End of training", token, revision, private)
        return job() if blocking else self.hub_push.submit(job)

    def _push_from_checkpoint(self, checkpoint_folder: str) -> None:
        """A checkpoint whose marker was just written (rank 0), pushed in the background per `hub_strategy`."""
        strategy = str(getattr(self.args.hub_strategy, "value", self.args.hub_strategy))
        if not self.args.push_to_hub or not self.is_world_process_zero() or strategy == "end":
            return
        if not self.args.hub_always_push and not self.hub_push.is_done():
            logger.info("hf_omni: %s not pushed, the previous push is still running", checkpoint_folder)
            return
        self.callback_handler.on_push_begin(self.args, self.state, self.control)
        name = os.path.basename(os.path.normpath(checkpoint_folder))
        extra = {"checkpoint": {"last-checkpoint": checkpoint_folder},
                 "all_checkpoints": {name: checkpoint_folder}}.get(strategy)
        self.hub_push.wait_until_done()  # hub_always_push: one at a time still
        step = name.rsplit("-", 1)[-1]
        self.hub_push.submit(self._push_job(checkpoint_folder, f"Training in progress, step {step}", extra=extra),
                             folder=checkpoint_folder)
