"""A ddp_spawn fit (2 ranks) whose rank ``--rank`` gets SIGTERM after step 5: the ranks stop together, and the
launching process exits with the ranks' status (143), not 1.

Usage: python preempt_spawn.py --dir SNAPDIR [--rank 1] [--no-signal]
"""

from __future__ import annotations

import argparse
import os
import signal

import lightning as L
from lightning.pytorch.demos.boring_classes import BoringModel

from lightning_snapshot import SnapshotCallback
from lightning_snapshot.backends import LocalTier


class Sig(L.Callback):
    def __init__(self, rank: int) -> None:
        self.rank = rank

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == 5 and trainer.global_rank == self.rank:
            os.kill(os.getpid(), signal.SIGTERM)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--dir", required=True)
    p.add_argument("--rank", type=int, default=1)
    p.add_argument("--no-signal", action="store_true")
    a = p.parse_args()
    callbacks = [SnapshotCallback(LocalTier(a.dir, every_n_train_steps=100))]
    if not a.no_signal:
        callbacks.append(Sig(a.rank))
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy="ddp_spawn",
        max_steps=12,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
    )
    trainer.fit(BoringModel())
    print("FIT RETURNED", flush=True)


if __name__ == "__main__":
    main()
