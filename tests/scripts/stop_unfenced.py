"""The fit stops (``trainer.should_stop``, as ``Timer(max_time)`` or ``EarlyStopping`` on a training metric do) after a
batch that only accumulated gradients, while the copy of the snapshot finished right before that batch is still in
flight (made slow here): no optimizer step comes to settle it, and the end of fit must not wait for its commit
before settling it itself (it did: a deadlock, the fit never returned).

Usage: python stop_unfenced.py --dir SNAPDIR
Prints ``FIT RETURNED step=S`` once ``fit`` returned.
"""

from __future__ import annotations

import argparse
import time

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.demos.boring_classes import BoringModel

from lightning_snapshot import SnapshotCallback
from lightning_snapshot.backends import LocalTier
from lightning_snapshot.staging.copier import SlotCopier

p = argparse.ArgumentParser()
p.add_argument("--dir", required=True)
a = p.parse_args()

copy = SlotCopier._copy


def slow_copy(self, handle, *args, **kwargs):  # (a copy that outlasts the next batch, as a large model's does)
    handle.go.wait()
    time.sleep(0.5)
    return copy(self, handle, *args, **kwargs)


SlotCopier._copy = slow_copy  # type: ignore[method-assign]


class StopAfterAccumulating(Callback):
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if batch_idx == 4:  # batches 0-3 made steps 1 and 2 (a snapshot at 2); batch 4 only accumulates
            trainer.should_stop = True


class Model(BoringModel):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Sequential(torch.nn.Linear(32, 512), torch.nn.Linear(512, 2))


trainer = L.Trainer(
    max_steps=100,
    accumulate_grad_batches=2,
    limit_val_batches=0,
    logger=False,
    callbacks=[SnapshotCallback(LocalTier(a.dir, every_n_train_steps=2)), StopAfterAccumulating()],
    enable_progress_bar=False,
    enable_model_summary=False,
    accelerator="cpu",
    devices=1,
)
trainer.fit(Model())
print(f"FIT RETURNED step={trainer.global_step}", flush=True)
