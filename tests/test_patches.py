"""After a fit, whether it ended normally or raised, no method the callback overrode on Lightning's objects remains."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_snapshot import SnapshotCallback
from lightning_snapshot.backends.local import LocalTier

#: every (object, attribute) the callback may override during a fit
PATCHED = [
    ("strategy", "process_dataloader"),
    ("epoch_loop", "_on_before_fetch"),
    ("epoch_loop", "on_run_start"),
    ("fit_loop", "on_advance_start"),
    ("fit_loop", "on_run_end"),
    ("fit_loop", "setup_data"),
]


class _Net(L.LightningModule):
    def __init__(self, fail_at: int | None = None) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)
        self.fail_at = fail_at

    def training_step(self, batch, batch_idx):
        if self.fail_at is not None and self.global_step == self.fail_at:
            raise RuntimeError("boom in training_step")
        x, y = batch
        return torch.nn.functional.mse_loss(self.layer(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class _Spy(L.Callback):
    """Records, mid-fit, which of the patched attributes are overridden on their instance (so the test cannot pass
    because nothing was ever patched)."""

    def __init__(self) -> None:
        self.seen: set[tuple[str, str]] = set()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.seen |= {(o, n) for o, n in PATCHED if n in vars(_owner(trainer, o))}


def _owner(trainer, name: str):
    return {"strategy": trainer.strategy, "epoch_loop": trainer.fit_loop.epoch_loop, "fit_loop": trainer.fit_loop}[name]


def _leftovers(trainer) -> list[tuple[str, str]]:
    return [(o, n) for o, n in PATCHED if n in vars(_owner(trainer, o))]


def _fit(tmp_path, model, max_steps=6, resume=True):
    spy = _Spy()
    cb = SnapshotCallback(LocalTier(tmp_path, every_n_train_steps=2), resume=resume)
    trainer = L.Trainer(
        max_steps=max_steps, callbacks=[spy, cb], logger=False, enable_progress_bar=False, enable_model_summary=False
    )
    data = DataLoader(TensorDataset(torch.randn(32, 4), torch.randn(32, 1)), batch_size=4)
    return trainer, spy, cb, data


def test_no_patch_remains_after_a_fit_that_ends_normally(tmp_path):
    trainer, spy, cb, data = _fit(tmp_path, _Net())
    trainer.fit(_Net(), data)
    assert {("strategy", "process_dataloader"), ("epoch_loop", "_on_before_fetch")} <= spy.seen
    assert _leftovers(trainer) == []
    assert not cb._patches


def test_no_patch_remains_after_a_resumed_fit(tmp_path):
    first, _, _, data = _fit(tmp_path, _Net(), max_steps=4)
    first.fit(_Net(), data)
    trainer, spy, cb, data = _fit(tmp_path, _Net(), max_steps=8)
    trainer.fit(_Net(), data)
    assert cb.restored_from is not None and cb.restored_from[1] == 4
    assert spy.seen and _leftovers(trainer) == []


def test_no_patch_remains_after_a_fit_that_raises(tmp_path):
    trainer, spy, cb, data = _fit(tmp_path, None)
    with pytest.raises(RuntimeError, match="boom in training_step"):
        trainer.fit(_Net(fail_at=3), data)
    assert spy.seen
    assert _leftovers(trainer) == []
    assert not cb._patches and cb._session is None
