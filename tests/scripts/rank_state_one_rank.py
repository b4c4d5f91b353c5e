"""Two processes under DDP (gloo): from step 4 on, rank 0 alone holds a value in its checkpoint state that the format
cannot store (rank-zero-only bookkeeping added in ``on_save_checkpoint``), so only rank 0 fails to take its state.
Every rank must agree on that failure: with ``on_error="warn"`` both train on, in step, and skip those snapshots (the
ranks' collectives went out of step, and gloo aborted the process); with ``"raise"`` both raise.

Usage: python rank_state_one_rank.py --dir SNAPDIR --on-error warn|raise
Each rank prints ``rank R: FIT RETURNED step=S`` or ``rank R: RAISED <type>: <message>``.
"""

from __future__ import annotations

import argparse

import lightning as L
from lightning.pytorch.demos.boring_classes import BoringModel

from lightning_snapshot import SnapshotCallback
from lightning_snapshot.backends import LocalTier


class Model(BoringModel):
    def on_save_checkpoint(self, checkpoint):
        if self.global_rank == 0 and self.global_step >= 4:
            checkpoint["rank0_only"] = object()  # (cannot be stored: a CaptureError on rank 0 only)


p = argparse.ArgumentParser()
p.add_argument("--dir", required=True)
p.add_argument("--on-error", choices=["warn", "raise"], required=True)
a = p.parse_args()
snapshots = SnapshotCallback(LocalTier(a.dir, every_n_train_steps=4), on_error=a.on_error, collective_timeout=30)
trainer = L.Trainer(
    max_steps=12,
    callbacks=[snapshots],
    logger=False,
    enable_progress_bar=False,
    enable_model_summary=False,
    limit_val_batches=0,
    accelerator="cpu",
    devices=2,
    strategy="ddp",
)
try:
    trainer.fit(Model())
    print(f"rank {trainer.global_rank}: FIT RETURNED step={trainer.global_step}", flush=True)
except Exception as e:  # noqa: BLE001 - (what each rank raised is the outcome)
    print(f"rank {trainer.global_rank}: RAISED {type(e).__name__}: {str(e)[:300]}", flush=True)
