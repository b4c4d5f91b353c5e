"""A collective of the snapshot's agreement fails (a peer gone, the group's timeout ran out) right after this rank
staged the snapshot's weights with the background copy held back: the fit must raise that error and the process exit,
not hang in the callback's teardown waiting for a copy that was never let go.

Usage: python agree_fail.py --dir SNAPDIR
One process (the failure is injected into ``LocalComm.all_true`` where the pipeline's stage agrees); prints
``RAISED <message>`` and exits 0 once the fit raised and the trainer was torn down.
"""

from __future__ import annotations

import argparse
import sys

import lightning as L
from lightning.pytorch.demos.boring_classes import BoringModel

from lightning_snapshot import SnapshotCallback
from lightning_snapshot.backends import LocalTier
from lightning_snapshot.comm import LocalComm

p = argparse.ArgumentParser()
p.add_argument("--dir", required=True)
a = p.parse_args()

original = LocalComm.all_true


def all_true(self: LocalComm, flag: bool) -> bool:
    if sys._getframe(1).f_code.co_name == "_stage_shared":  # (the agreement right after staging)
        raise RuntimeError("injected: the other ranks did not answer within the collective timeout")
    return original(self, flag)


LocalComm.all_true = all_true  # type: ignore[method-assign]
trainer = L.Trainer(max_steps=8, callbacks=[SnapshotCallback(LocalTier(a.dir, every_n_train_steps=4))], logger=False,
                    enable_progress_bar=False, enable_model_summary=False, accelerator="cpu", devices=1)
try:
    trainer.fit(BoringModel())
except RuntimeError as e:
    print(f"RAISED {e}", flush=True)
