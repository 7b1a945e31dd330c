"""Per-module figures reach Trainer's `report_to` integrations as Trainer's own do: TensorBoard's event file,
read back, holds `lr/<module>` and `grad_norm/<module>` at every logged step, beside Trainer's `loss`."""

import pytest
from helpers import make_args, tiny_data, tiny_model

from hf_omni import OmniTrainer

MODULES = {"vision": {"trainable": False}, "projector": {"learning_rate": 3e-3, "lr_scheduler_type": "constant"},
           "llm": {"learning_rate": 1e-3, "lr_scheduler_type": "constant"}}


def test_tensorboard_event_file_holds_per_module_figures(tmp_path, monkeypatch):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    monkeypatch.setenv("TENSORBOARD_LOGGING_DIR", str(tmp_path / "tb"))  # transformers 5's way to place it
    model = tiny_model()
    args = make_args(tmp_path, max_steps=4, modules=MODULES, report_to="tensorboard", logging_steps=1)
    trainer = OmniTrainer(model=model, args=args, train_dataset=tiny_data(model, 32))
    trainer.train()
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    for tag in ("train/lr/projector", "train/lr/llm", "train/grad_norm/projector", "train/grad_norm/llm",
                "train/loss"):
        assert tag in tags, sorted(tags)
        assert [e.step for e in events.Scalars(tag)] == [1, 2, 3, 4]
    assert [e.value for e in events.Scalars("train/lr/projector")] == pytest.approx([3e-3] * 4)
    assert [e.value for e in events.Scalars("train/lr/llm")] == pytest.approx([1e-3] * 4)
    logged = [e for e in trainer.state.log_history if "grad_norm/llm" in e]
    assert [e.value for e in events.Scalars("train/grad_norm/llm")] == pytest.approx([e["grad_norm/llm"] for e in logged])


def test_progress_bars_for_checkpoint_writes_exports_and_encoding(tmp_path, capsys):
    """Bars on stderr while a checkpoint is written, an export copied and an offline cache encoded; none with
    Trainer's `disable_tqdm` (checkpoints) or transformers' `disable_progress_bar()` (everything)."""
    from transformers.utils import logging

    from hf_omni.cli import export

    model = tiny_model()
    modules = {**MODULES, "vision": {"trainable": False}}
    args = make_args(tmp_path / "run", max_steps=2, modules=modules, save_strategy="steps", save_steps=2,
                     disable_tqdm=False, offline_modules=["vision"])
    trainer = OmniTrainer(model=model, args=args, train_dataset=tiny_data(model, 32))
    trainer.train()
    trainer.save_model(str(tmp_path / "export"))
    export(str(tmp_path / "run" / "checkpoint-2"), str(tmp_path / "export2"))
    err = capsys.readouterr().err
    for bar in ("encoding 'vision' offline", f"saving {tmp_path / 'run' / 'checkpoint-2'}",
                f"exporting to {tmp_path / 'export'}", "exporting " + str(tmp_path / "run" / "checkpoint-2")):
        assert bar in err, bar
    logging.disable_progress_bar()
    try:
        export(str(tmp_path / "run" / "checkpoint-2"), str(tmp_path / "export3"))
    finally:
        logging.enable_progress_bar()
    assert "exporting" not in capsys.readouterr().err
