"""lightning_snapshot.state.capture.loop_state_dict: the fit loop's state dict, as Lightning's ``state_dict()`` makes it,
at every point of a fit where a snapshot can be taken; progress it cannot read field by field goes through
``dataclasses.asdict`` (a copy, never the live object), and an overridden ``state_dict`` is called."""

from __future__ import annotations

import dataclasses

import lightning.pytorch as L
import torch
from lightning.pytorch.demos.boring_classes import BoringModel
from lightning.pytorch.loops.progress import _BaseProgress, _Progress

from lightning_snapshot.state.capture import loop_state_dict


class _Compare(L.Callback):
    """Compares the two at each batch end, validation end and epoch end (the points a snapshot is taken near)."""

    def __init__(self) -> None:
        self.compared = 0

    def _check(self, trainer: L.Trainer) -> None:
        ours, theirs = loop_state_dict(trainer.fit_loop), trainer.fit_loop.state_dict()
        assert ours == theirs
        assert list(ours) == list(theirs)  # the same keys in the same order
        self.compared += 1

    def on_train_batch_end(self, trainer, *args) -> None:
        self._check(trainer)

    def on_validation_end(self, trainer, *args) -> None:
        self._check(trainer)

    def on_train_epoch_end(self, trainer, *args) -> None:
        self._check(trainer)


def test_the_fit_loops_state_dict_is_lightnings_throughout_a_fit(tmp_path):
    compare = _Compare()
    trainer = L.Trainer(
        default_root_dir=tmp_path,
        max_epochs=2,
        limit_train_batches=5,
        limit_val_batches=2,
        val_check_interval=2,
        callbacks=[compare],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(BoringModel())
    assert compare.compared >= 14
    state = loop_state_dict(trainer.fit_loop)
    assert state["epoch_loop.batch_progress"]["total"]["completed"] == 10
    assert state["epoch_loop.val_loop.batch_progress"]["total"]["completed"] > 0  # (validation ran)


@dataclasses.dataclass
class _Listed(_Progress):
    seen: list = dataclasses.field(default_factory=list)


def test_progress_with_a_mutable_field_is_copied_as_asdict_copies_it(tmp_path):
    trainer = L.Trainer(default_root_dir=tmp_path, max_steps=1, logger=False, enable_progress_bar=False)
    trainer.fit(BoringModel())
    loop = trainer.fit_loop
    loop.extra_progress = _Listed(seen=[1, 2])
    state = loop_state_dict(loop)
    assert state == loop.state_dict()
    assert state["extra_progress"]["seen"] == [1, 2]
    loop.extra_progress.seen.append(3)  # the live list changes: the state taken before does not
    assert state["extra_progress"]["seen"] == [1, 2]


def test_an_overridden_state_dict_is_the_one_called(tmp_path):
    class Counted(_BaseProgress):
        def state_dict(self) -> dict:
            return {"own": True}

    trainer = L.Trainer(default_root_dir=tmp_path, max_steps=1, logger=False, enable_progress_bar=False)
    trainer.fit(BoringModel())
    loop = trainer.fit_loop
    loop.counted = Counted()
    assert loop_state_dict(loop)["counted"] == {"own": True}

    class Own(type(loop)):
        def state_dict(self, destination=None, prefix=""):
            return {"replaced": torch.tensor(1.0).item()}

    loop.__class__ = Own
    assert loop_state_dict(loop) == {"replaced": 1.0}
