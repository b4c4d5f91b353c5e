"""Training run under ddp_spawn / ddp_fork (2 CPU processes), used by tests/test_spawn.py.

Usage: python spawn_train.py --dir SNAPDIR --out RESULT [--strategy ddp_spawn|ddp_fork] [--max-steps N] [--every K]
[--kill-at S]

The worker processes hold the trained state (with ddp_spawn the optimizer state never comes back to the launcher), so
each rank saves its final weights, optimizer state, learning rate, step and what it restored from to RESULT.rank<r>
(torch.save of plain values, read back with weights_only=True) at the end of training. ``--kill-at S`` SIGKILLs rank
0's worker process at global step S once a snapshot is committed; the launcher then exits non-zero.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time

import lightning as L
import torch
from fingerprint import capture
from torch import nn
from torch.utils.data import DataLoader, Dataset

from lightning_snapshot import SnapshotCallback
from lightning_snapshot.backends import LocalTier


class Squares(Dataset):
    def __init__(self, n: int = 64) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, 8, generator=g)
        self.y = torch.randn(n, 1, generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        return self.x[i], self.y[i]


class Model(L.LightningModule):
    def __init__(self, dropout: float) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(dropout), nn.Linear(16, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=1e-2)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.9)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class KillRank0(L.Callback):
    """SIGKILL rank 0's worker at ``global_step == at``, once the tier holds a committed snapshot."""

    def __init__(self, at: int, tier) -> None:
        self.at = at
        self.tier = tier

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == self.at and trainer.global_rank == 0:
            from lightning_snapshot.persist.writer import committed_steps

            deadline = time.monotonic() + 30
            while not committed_steps(self.tier) and time.monotonic() < deadline:
                time.sleep(0.01)
            print(f"KILLING rank 0 at step {trainer.global_step}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)


class SaveResult(L.Callback):
    """Save this rank's final state at the end of training, inside the worker process."""

    def __init__(self, out: str, snapshots: SnapshotCallback) -> None:
        self.out = out
        self.snapshots = snapshots

    def on_train_end(self, trainer, pl_module):
        restored = self.snapshots.restored_from
        result = {
            **capture(trainer, pl_module),
            "restored_step": -1 if restored is None else restored[1],
            "pid": os.getpid(),
        }
        torch.save(result, f"{self.out}.rank{trainer.global_rank}")
        if restored is not None:
            print(f"RESTORED step={restored[1]} rank={trainer.global_rank}", flush=True)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--dir", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--strategy", choices=["ddp_spawn", "ddp_fork"], default="ddp_spawn")
    p.add_argument("--max-steps", type=int, default=10)
    p.add_argument("--every", type=int, default=2)
    p.add_argument("--kill-at", type=int, default=-1)
    p.add_argument("--dropout", type=float, default=0.1)
    a = p.parse_args()

    L.seed_everything(42, verbose=False)
    tier = LocalTier(a.dir, every_n_train_steps=a.every, keep_last=2)
    snapshots = SnapshotCallback([tier])
    callbacks = [snapshots, SaveResult(a.out, snapshots)]
    if a.kill_at >= 0:
        callbacks.append(KillRank0(a.kill_at, tier))
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=a.strategy,
        max_steps=a.max_steps,
        callbacks=callbacks,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        deterministic=True,
    )
    trainer.fit(Model(a.dropout), DataLoader(Squares(), batch_size=4, shuffle=False))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
