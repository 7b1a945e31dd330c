"""The Trainer hooks OmniTrainer overrides still exist with the signatures it relies on."""

import pytest
from transformers import Trainer

from hf_omni import OmniTrainer
from hf_omni.trainer.hooks import OVERRIDES, TRAINER_METHODS, check_trainer_hooks


def test_installed_trainer_has_every_hook():
    check_trainer_hooks()
    for name, (role, _) in TRAINER_METHODS.items():
        overridden = getattr(OmniTrainer, name) is not getattr(Trainer, name)
        assert overridden == (role == OVERRIDES), f"OmniTrainer {role} {name}, but it {'does not' * (not overridden)}"


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
