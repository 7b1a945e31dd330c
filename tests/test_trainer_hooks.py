"""The Trainer hooks OmniTrainer overrides still exist with the signatures it relies on."""

import pytest
from transformers import Trainer

from hf_omni.trainer import TRAINER_HOOKS, OmniTrainer, check_trainer_hooks


def test_installed_trainer_has_every_hook():
    check_trainer_hooks()
    for name in TRAINER_HOOKS:
        assert getattr(OmniTrainer, name) is not getattr(Trainer, name), f"OmniTrainer no longer overrides {name}"


def test_changed_hook_fails_loudly_naming_the_method():
    class Renamed(Trainer):
        def _clip_grad_norm(self, model, max_norm):  # a new parameter
            return None

    with pytest.raises(RuntimeError, match=r"Trainer\._clip_grad_norm changed signature"):
        check_trainer_hooks(Renamed)

    class Gone(Trainer):
        pass

    Gone._prepare_for_training = None
    with pytest.raises(RuntimeError, match=r"Trainer\._prepare_for_training no longer exists"):
        check_trainer_hooks(Gone)
