"""Tensors that user code changes in place during a step, while the snapshot of the step before is being copied.

A snapshot taken at ``on_train_batch_end`` copies the trained parameters and the optimizer state while the next
forward and backward run. Self-supervised setups change tensors in place in ``training_step``: an EMA teacher that
no optimizer trains (``teacher.mul_(m).add_(student)``, often through ``.data``), or SwAV's prototypes, trained and
normalized at the start of every step. The copy here is slowed down (as a large model's is) so that the step's
changes always land while it runs: every committed snapshot must still hold the values of its own step.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
import warnings
from pathlib import Path

import lightning as L
import pytest
import torch
from fingerprint import assert_same_run, capture
from lightning.pytorch.callbacks import Callback
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_snapshot import SnapshotCallback, load_snapshot
from lightning_snapshot.backends import LocalTier
from lightning_snapshot.staging.copier import SlotCopier


@pytest.fixture
def slow_copy(monkeypatch):
    """The background copy starts 0.2 s late: the next step's training_step always runs while it is pending."""
    copy = SlotCopier._copy

    def late(self, *args, **kwargs):
        time.sleep(0.2)
        return copy(self, *args, **kwargs)

    monkeypatch.setattr(SlotCopier, "_copy", late)


class Teacher(L.LightningModule):
    """A student trained by SGD and an EMA teacher (a parameter no optimizer trains) updated in training_step."""

    def __init__(self, style: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.style = style
        self.student = nn.Linear(16, 64)
        self.teacher = nn.Linear(16, 64)
        self.teacher.requires_grad_(False)

    def training_step(self, batch, batch_idx):
        with torch.no_grad():
            for t, s in zip(self.teacher.parameters(), self.student.parameters(), strict=True):
                if self.style == "no_grad":
                    t.mul_(0.9).add_(s, alpha=0.1)
                elif self.style == "data":  # (DINO's update: no version counter sees it)
                    t.data.mul_(0.9).add_(s.data, alpha=0.1)
                else:  # (lightly's update_momentum: the parameter gets new storage)
                    t.data = t.data * 0.9 + s.data * 0.1
        x, y = batch
        return nn.functional.mse_loss(self.student(x) + self.teacher(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.student.parameters(), lr=0.1)


class Prototypes(L.LightningModule):
    """SwAV's prototypes: trained, and normalized in place at the start of every training_step. ``count`` of them
    (64: 4 KiB, copied at once with the other small tensors; 2048: 128 KiB, copied while training goes on)."""

    def __init__(self, count: int = 64) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.proto = nn.Linear(16, count, bias=False)
        self.head = nn.Linear(count, 1)

    def training_step(self, batch, batch_idx):
        with torch.no_grad():
            self.proto.weight.copy_(nn.functional.normalize(self.proto.weight, dim=1))
        x, y = batch
        return nn.functional.mse_loss(self.head(self.proto(x)), y[:, :1])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class Record(Callback):
    """The model's state at every step's on_train_batch_end, where the snapshot of that step is taken."""

    def __init__(self) -> None:
        self.seen: dict[int, dict[str, torch.Tensor]] = {}

    def on_train_batch_end(self, trainer, pl_module, *args):
        self.seen[trainer.global_step] = {k: v.detach().clone() for k, v in pl_module.state_dict().items()}


def _loader() -> DataLoader:
    g = torch.Generator().manual_seed(0)
    return DataLoader(TensorDataset(torch.randn(64, 16, generator=g), torch.randn(64, 64, generator=g)), batch_size=8)


def _fit(model: L.LightningModule, root: Path, steps: int, *callbacks, resume=True) -> list[str]:
    return _fit_run(model, root, steps, *callbacks, resume=resume)[1]


def _fit_run(
    model: L.LightningModule, root: Path, steps: int, *callbacks, resume=True
) -> tuple[dict, list[str], SnapshotCallback]:
    """Fit ``model``; returns what it ended with (``fingerprint.capture``), the library's warnings and its
    callback."""
    snapshot = SnapshotCallback(LocalTier(root, every_n_train_steps=1, keep_last=50), resume=resume)
    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=steps,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=True,
        deterministic=True,
        callbacks=[*callbacks, snapshot],
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(model, _loader())
    return (
        capture(trainer, model),
        [str(w.message) for w in caught if "lightning-snapshot" in str(w.message)],
        snapshot,
    )


def _assert_resumes_exactly(make, root: Path, steps: int, cut_at: int, *callbacks) -> None:
    """A fit of ``steps`` steps, and the same fit cut after the snapshot of ``cut_at`` (the newer snapshots deleted,
    as a kill would have left them) and rerun: the rerun resumes from ``cut_at`` and ends as the whole fit did."""
    whole = _fit_run(make(), root / "whole", steps, *callbacks)[0]
    _fit(make(), root / "cut", steps, *callbacks)
    for p in (root / "cut").glob("step-*"):
        if int(p.name.split("-")[1]) > cut_at:
            shutil.rmtree(p)
    resumed, _, snapshot = _fit_run(make(), root / "cut", steps, *callbacks)
    assert snapshot.restored_from is not None, "the rerun did not resume"
    assert snapshot.restored_from[:2] == (str(root / "cut"), cut_at), snapshot.restored_from
    assert_same_run(whole, resumed, since=cut_at)


def _committed(root: Path) -> list[int]:
    return sorted(int(p.name.split("-")[1]) for p in root.glob("step-*") if (p / "manifest.json").exists())


def _assert_snapshots_hold_their_steps(root: Path, seen: dict[int, dict[str, torch.Tensor]]) -> list[int]:
    steps = _committed(root)
    for step in steps:
        state = load_snapshot(root, step=step)["state_dict"]
        for name, want in seen[step].items():
            assert torch.equal(state[name], want), f"step {step}: {name} is not the value it had at that step"
    return steps


@pytest.mark.parametrize("style", ["no_grad", "data", "reassign"])
def test_an_ema_teacher_changed_in_training_step_is_snapshotted_at_its_step(tmp_path, slow_copy, style):
    record = Record()
    messages = _fit(Teacher(style), tmp_path, 6, record)
    assert _assert_snapshots_hold_their_steps(tmp_path, record.seen) == [1, 2, 3, 4, 5, 6]
    assert not [m for m in messages if "skipped" in m]  # (the teacher is copied at once: nothing to drop)


def test_resume_from_a_snapshot_taken_while_the_teacher_changed_is_exact(tmp_path, slow_copy):
    # (the run was killed after step 4's snapshot was committed)
    _assert_resumes_exactly(lambda: Teacher("data"), tmp_path, 8, 4)


def test_a_trained_tensor_changed_in_training_step_drops_that_snapshot_never_commits_a_torn_one(tmp_path, slow_copy):
    record = Record()
    messages = _fit(Prototypes(2048), tmp_path, 6, record)
    skipped = [m for m in messages if "skipped the snapshot" in m]
    assert len(skipped) == 1, messages
    assert "'state_dict/proto.weight'" in skipped[0] and "copied at once from now on" in skipped[0]
    # the first snapshot could hold either value and is not committed; from the next one the prototypes are copied
    # before training_step runs, and every snapshot holds its step
    assert _assert_snapshots_hold_their_steps(tmp_path, record.seen) == [2, 3, 4, 5, 6]


def test_small_trained_tensors_changed_in_training_step_are_copied_before_it_and_never_torn(tmp_path, slow_copy):
    """A state of small tensors (a few MiB in all) is copied at once when it is staged: what training_step then
    changes in place cannot reach the snapshot, and none is dropped."""
    record = Record()
    messages = _fit(Prototypes(64), tmp_path, 6, record)
    assert not [m for m in messages if "skipped" in m], messages
    assert _assert_snapshots_hold_their_steps(tmp_path, record.seen) == [1, 2, 3, 4, 5, 6]


class ResetMoments(Callback):
    """Resets Adam's first moments in place at the end of every epoch (as a warm-restart callback might)."""

    def on_train_epoch_end(self, trainer, pl_module):
        for state in trainer.optimizers[0].state.values():
            state["exp_avg"].zero_()


class Plain(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Linear(16, 64)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=0.01)


def test_optimizer_state_changed_at_the_end_of_an_epoch_is_snapshotted_as_the_next_step_begins(tmp_path, slow_copy):
    """The last step of an epoch is due at on_train_batch_end, then epoch-end hooks change the optimizer state before
    the next step: the snapshot holds the state the next step begins with, and resuming from it is exact."""
    _assert_resumes_exactly(Plain, tmp_path, 12, 8, ResetMoments())  # (8 batches per epoch)
    state = load_snapshot(tmp_path / "whole", step=8)
    assert all(not s["exp_avg"].any() for s in state["optimizer_states"][0]["state"].values())


class ShrinkThroughData(Callback):
    """Shrinks the weights at the end of every epoch through ``.data`` (no version counter moves), as a
    weight-decay-at-epoch-end callback written the old way might."""

    def on_train_epoch_end(self, trainer, pl_module):
        time.sleep(0.2)  # (a copy of the step's weights started before this hook has long finished)
        pl_module.net.weight.data.mul_(0.5)


def test_weights_changed_through_data_at_the_end_of_an_epoch_are_in_the_snapshot(tmp_path):
    """A change that no version counter sees, made after on_train_batch_end of an epoch's last step and before the
    next step: the snapshot of that step holds it (the whole state is taken as the next step begins), and resuming
    from it is exact."""
    _assert_resumes_exactly(Plain, tmp_path, 12, 8, ShrinkThroughData())  # (8 batches per epoch)


class FreezeAtEpoch1(Callback):
    def on_train_epoch_start(self, trainer, pl_module):
        if trainer.current_epoch == 1:
            pl_module.a.requires_grad_(False)


class FrozenLater(L.LightningModule):
    """``a`` is trained in epoch 0, then frozen (it stays in the optimizer's group) and decayed through ``.data``
    in every training_step, as a teacher would be."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(16, 64)
        self.b = nn.Linear(16, 64)

    def training_step(self, batch, batch_idx):
        if not self.a.weight.requires_grad:
            self.a.weight.data.mul_(0.9)
        x, y = batch
        return nn.functional.mse_loss(self.a(x) + self.b(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_a_parameter_frozen_during_fit_is_copied_at_once_from_then_on(tmp_path, slow_copy):
    record = Record()
    messages = _fit(FrozenLater(), tmp_path, 12, FreezeAtEpoch1(), record)  # (8 batches per epoch)
    assert _assert_snapshots_hold_their_steps(tmp_path, record.seen) == list(range(1, 13))
    assert not [m for m in messages if "skipped" in m]


def _swap_data(root: Path, kind: str) -> str:
    """tests/scripts/swap_data.py: in a fresh process (a crash there must not take the test run with it), and a fresh
    interpreter, not the tests' fork server, whose allocator has long been in use and may keep freed memory as it
    was."""
    script = Path(__file__).parent / "scripts" / "swap_data.py"
    proc = subprocess.run([sys.executable, str(script), str(root), kind], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"rc={proc.returncode}\n{proc.stderr[-3000:]}"
    return proc.stdout


def test_a_large_trained_parameter_given_new_storage_while_it_is_copied_neither_crashes_nor_is_committed_wrong(
    tmp_path,
):
    """``.data = ...`` on a trained 41 MB parameter in training_step, while the snapshot of the step before is still
    being copied from its address: its old storage is freed (unmapped). The copy still reads that step's values from
    it (before: a committed snapshot with other values, or a segmentation fault)."""
    out = _swap_data(tmp_path, "big")
    assert "OK [1, 2, 3, 4, 5]" in out, out[-2000:]
    assert "WARNING" not in out, out[-2000:]


def test_small_trained_tensors_given_new_storage_while_they_are_copied_drop_that_snapshot(tmp_path):
    """The same with 18 MB of small tensors (more than are copied at once), which the copy thread copies through the
    tensor objects: a tensor given new storage before the fence would be copied from that, so the snapshot is torn,
    not committed, and every committed one holds its step."""
    out = _swap_data(tmp_path, "small")
    assert "OK [1, 3, 4, 5]" in out, out[-2000:]
    assert "skipped the snapshot of step 2: 'state_dict/net.0.weight'" in out and "new storage" in out, out[-2000:]
