"""The private parts of transformers' Trainer that the fast path relies on, held against the pinned version.

training/fastpath/trainer.py lists every private Trainer method it (or a mixin of it) overrides in
PRIVATE_OVERRIDES, with why no public hook does it, and the private methods those overrides call in
PRIVATE_CALLS. An upgrade of transformers or TRL that renames one, changes its parameters or drops a private
attribute the overrides read fails here, by name, instead of training silently wrong.
"""

from __future__ import annotations

import inspect

import pytest

pytest.importorskip("trl")

from transformers import Trainer  # noqa: E402
from trl import SFTTrainer  # noqa: E402

from training.checkpoints import with_background_checkpoints  # noqa: E402
from training.fastpath.trainer import PRIVATE_CALLS, PRIVATE_OVERRIDES, PackedSFTTrainer  # noqa: E402

# (parameter, kind, has a default) of each method, as transformers 5.24.0 defines it (requirements.txt).
SIGNATURES: dict[str, list[tuple[str, str, bool]]] = {
    "_prepare_input": [("self", "POSITIONAL_OR_KEYWORD", False), ("data", "POSITIONAL_OR_KEYWORD", False)],
    "_get_num_items_in_batch": [("self", "POSITIONAL_OR_KEYWORD", False),
                                ("batch_samples", "POSITIONAL_OR_KEYWORD", False),
                                ("device", "POSITIONAL_OR_KEYWORD", False)],
    "_maybe_log_save_evaluate": [("self", "POSITIONAL_OR_KEYWORD", False), ("tr_loss", "POSITIONAL_OR_KEYWORD", False),
                                 ("grad_norm", "POSITIONAL_OR_KEYWORD", False), ("model", "POSITIONAL_OR_KEYWORD", False),
                                 ("trial", "POSITIONAL_OR_KEYWORD", False), ("epoch", "POSITIONAL_OR_KEYWORD", False),
                                 ("ignore_keys_for_eval", "POSITIONAL_OR_KEYWORD", False),
                                 ("start_time", "POSITIONAL_OR_KEYWORD", False),
                                 ("learning_rate", "POSITIONAL_OR_KEYWORD", True)],
    "_finalize_training": [("self", "POSITIONAL_OR_KEYWORD", False), ("trial", "POSITIONAL_OR_KEYWORD", False),
                           ("num_train_samples", "POSITIONAL_OR_KEYWORD", False),
                           ("start_time", "POSITIONAL_OR_KEYWORD", False)],
    "_save_checkpoint": [("self", "POSITIONAL_OR_KEYWORD", False), ("model", "POSITIONAL_OR_KEYWORD", False),
                         ("trial", "POSITIONAL_OR_KEYWORD", False)],
    "_save": [("self", "POSITIONAL_OR_KEYWORD", False), ("output_dir", "POSITIONAL_OR_KEYWORD", True),
              ("state_dict", "POSITIONAL_OR_KEYWORD", True)],
    "_save_scaler": [("self", "POSITIONAL_OR_KEYWORD", False), ("output_dir", "POSITIONAL_OR_KEYWORD", False)],
    "_save_rng_state": [("self", "POSITIONAL_OR_KEYWORD", False), ("output_dir", "POSITIONAL_OR_KEYWORD", False)],
    "_get_output_dir": [("self", "POSITIONAL_OR_KEYWORD", False), ("trial", "POSITIONAL_OR_KEYWORD", False)],
    "_get_learning_rate": [("self", "POSITIONAL_OR_KEYWORD", False)],
}
# Private attributes the deferred logs and the token accounting read or reset: (module, attribute).
ATTRIBUTES = (("transformers.trainer", "_globalstep_last_logged"), ("transformers.trainer", "_total_loss_scalar"),
              ("trl.trainer.sft_trainer", "_metrics"))


def shape(method) -> list[tuple[str, str, bool]]:
    return [(p.name, p.kind.name, p.default is not inspect.Parameter.empty)
            for p in inspect.signature(method).parameters.values()]


def test_the_table_covers_every_private_method_the_fast_path_relies_on():
    assert set(SIGNATURES) == set(PRIVATE_OVERRIDES) | set(PRIVATE_CALLS)
    assert all(len(why) > 20 for why in PRIVATE_OVERRIDES.values())  # each says why


@pytest.mark.parametrize("name", sorted(SIGNATURES))
def test_pinned_trainer_keeps_the_signature(name):
    method = getattr(Trainer, name, None)
    assert method is not None, f"transformers.Trainer.{name} is gone: the fast path overrides or calls it"
    assert shape(method) == SIGNATURES[name], (
        f"transformers.Trainer.{name} changed its signature to {inspect.signature(method)}: update the fast "
        "path's override (training/fastpath/trainer.py PRIVATE_OVERRIDES) before this table")
    # TRL's SFTTrainer must not have put its own version in between with other parameters.
    assert shape(getattr(SFTTrainer, name)) == SIGNATURES[name], f"trl.SFTTrainer.{name} differs"


def test_every_private_override_is_listed():
    """A private Trainer method overridden anywhere in the fast path's trainer and not in PRIVATE_OVERRIDES
    (or a listed one that is no longer overridden) fails here."""
    trainer = with_background_checkpoints(PackedSFTTrainer)
    overridden = set()
    for cls in trainer.__mro__:
        if cls in (SFTTrainer, Trainer) or issubclass(SFTTrainer, cls):
            break
        overridden |= {name for name, value in vars(cls).items()
                       if name.startswith("_") and not name.startswith("__") and callable(value)
                       and hasattr(Trainer, name)}
    assert overridden == set(PRIVATE_OVERRIDES)


@pytest.mark.parametrize("module, name", ATTRIBUTES)
def test_private_attributes_are_still_there(module, name):
    import importlib

    assert f"self.{name}" in inspect.getsource(importlib.import_module(module)), f"{module} has no self.{name}"
