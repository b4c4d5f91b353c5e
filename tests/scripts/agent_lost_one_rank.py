"""Two processes under DDP (gloo), one node: a RAM tier, whose snapshot agent writes the durable tiers, and a local
tier. At step 5 rank 1 alone loses its link to the agent (as when the agent is silent for too long): from then on
the ranks must still write each durable snapshot the same way. Rank 1 used to write the local tier itself, over the
tier's collectives, while rank 0 handed it to its agent: each waited for the other's part in vain, and no later
snapshot of the fit reached the local tier.

Usage: python agent_lost_one_rank.py --dir SNAPDIR   (LIGHTNING_SNAPSHOT_SHM_DIR: the agents' base directory)
Each rank prints ``rank R: FIT RETURNED step=S`` or ``rank R: RAISED <type>: <message>``.
"""

from __future__ import annotations

import argparse

import lightning as L
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.demos.boring_classes import BoringModel

from lightning_snapshot import SnapshotCallback
from lightning_snapshot.backends import LocalTier, RamTier

p = argparse.ArgumentParser()
p.add_argument("--dir", required=True)
a = p.parse_args()


class LoseTheAgent(Callback):
    def __init__(self, snapshots: SnapshotCallback) -> None:
        self.snapshots = snapshots

    def on_train_batch_end(self, trainer, *args):
        if trainer.global_rank == 1 and trainer.global_step == 5:
            self.snapshots._session.agent._lose("injected: rank 1 lost the link to its snapshot agent")


snapshots = SnapshotCallback(
    [
        RamTier(every_n_train_steps=4, name="agent-lost", idle_timeout=30),
        LocalTier(a.dir, every_n_train_steps=4, keep_last=None),
    ],
    on_error="warn",
    collective_timeout=10,
    shutdown_timeout=5,
)
trainer = L.Trainer(
    max_steps=12,
    callbacks=[snapshots, LoseTheAgent(snapshots)],
    logger=False,
    enable_progress_bar=False,
    enable_model_summary=False,
    limit_val_batches=0,
    accelerator="cpu",
    devices=2,
    strategy="ddp",
)
try:
    trainer.fit(BoringModel())
    print(f"rank {trainer.global_rank}: FIT RETURNED step={trainer.global_step}", flush=True)
except Exception as e:  # noqa: BLE001 - (what each rank raised is the outcome)
    print(f"rank {trainer.global_rank}: RAISED {type(e).__name__}: {str(e)[:300]}", flush=True)
