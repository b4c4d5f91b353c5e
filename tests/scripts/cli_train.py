"""A tiny LightningCLI script, run twice with the same command line by tests/test_spawn.py (rerun after a crash).

Usage: python cli_train.py fit --config CONFIG.yaml

``LS_TEST_KILL_AT=S`` in the environment SIGKILLs the process at global step S, once a snapshot is committed in the
tiers of the SnapshotCallback the config adds. ``LS_TEST_NO_OVERWRITE=1`` leaves out
``save_config_kwargs={"overwrite": True}`` (to show what a rerun meets without it).
"""

from __future__ import annotations

import os
import signal
import sys
import time

import lightning as L
import torch
from lightning.pytorch.cli import LightningCLI
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class Model(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(0)
        return DataLoader(TensorDataset(torch.randn(64, 8, generator=g), torch.randn(64, 1, generator=g)), batch_size=4)


class KillAfterSnapshot(L.Callback):
    """SIGKILL this process at ``global_step == at`` once the SnapshotCallback's tiers hold a committed snapshot."""

    def __init__(self, at: int) -> None:
        self.at = at

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step != self.at:
            return
        from lightning_snapshot import SnapshotCallback
        from lightning_snapshot.persist.writer import committed_steps

        tiers = [t for cb in trainer.callbacks if isinstance(cb, SnapshotCallback) for t in cb.tiers]
        deadline = time.monotonic() + 30
        while not any(committed_steps(t) for t in tiers) and time.monotonic() < deadline:
            time.sleep(0.01)
        print(f"KILLING at step {trainer.global_step}", flush=True)
        sys.stdout.flush()
        os.kill(os.getpid(), signal.SIGKILL)


def main() -> None:
    kill_at = int(os.environ.get("LS_TEST_KILL_AT", "-1"))
    defaults = {"callbacks": [KillAfterSnapshot(kill_at)]} if kill_at >= 0 else {}
    kwargs = {} if os.environ.get("LS_TEST_NO_OVERWRITE") else {"save_config_kwargs": {"overwrite": True}}
    LightningCLI(Model, trainer_defaults=defaults, seed_everything_default=42, **kwargs)


if __name__ == "__main__":
    main()
