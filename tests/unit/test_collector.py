"""lightning_snapshot.format.collector: the persist threads' windows without the cyclic garbage collector leave it as the
program had it, however they nest across threads and whatever happens inside them."""

from __future__ import annotations

import gc
import threading

import pytest

from lightning_snapshot.format.collector import deferred_collection


@pytest.fixture(autouse=True)
def collector_enabled():
    was = gc.isenabled()
    gc.enable()
    yield
    (gc.enable if was else gc.disable)()


def test_a_window_disables_the_collector_and_enables_it_again_even_when_its_body_raises():
    with deferred_collection():
        assert not gc.isenabled()
    assert gc.isenabled()
    with pytest.raises(RuntimeError), deferred_collection():
        raise RuntimeError("inside")
    assert gc.isenabled()


def test_windows_of_two_threads_keep_it_disabled_until_the_last_one_ends():
    first_in, second_in, first_out = threading.Event(), threading.Event(), threading.Event()
    seen: list[bool] = []

    def second() -> None:
        first_in.wait()
        with deferred_collection():
            second_in.set()
            first_out.wait()
            seen.append(gc.isenabled())  # (the first window has ended; this one is still open)

    t = threading.Thread(target=second)
    t.start()
    with deferred_collection():
        first_in.set()
        second_in.wait()
    first_out.set()
    t.join()
    assert seen == [False]
    assert gc.isenabled()


def test_a_program_that_disabled_the_collector_keeps_it_disabled():
    gc.disable()
    with deferred_collection(), deferred_collection():
        pass
    assert not gc.isenabled()


def test_a_fit_with_snapshots_leaves_the_collector_enabled(tmp_path):
    import lightning as L
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_snapshot import SnapshotCallback
    from lightning_snapshot.backends import LocalTier

    class Model(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layers = torch.nn.Sequential(*(torch.nn.Linear(4, 4) for _ in range(20)))

        def training_step(self, batch, batch_idx):
            return self.layers(batch[0]).pow(2).mean()

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters())

    data = DataLoader(TensorDataset(torch.randn(64, 4)), batch_size=4)
    callback = SnapshotCallback(LocalTier(tmp_path / "snap", every_n_train_steps=1), resume=False)
    L.Trainer(
        max_steps=12, logger=False, enable_progress_bar=False, enable_model_summary=False, callbacks=[callback]
    ).fit(Model(), data)
    assert gc.isenabled()


def test_a_process_forked_while_a_window_is_open_starts_with_the_collector_enabled():
    """(A DataLoader worker forked while a persist thread builds a manifest.)"""
    import os

    with deferred_collection():
        pid = os.fork()
        if pid == 0:  # the child: its collector, and a window of its own
            code = 0 if gc.isenabled() else 3
            with deferred_collection():
                code = code or (0 if not gc.isenabled() else 4)
            os._exit(code or (0 if gc.isenabled() else 5))
        _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert gc.isenabled()
