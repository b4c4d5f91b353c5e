"""A collective of the snapshot's agreement fails (a peer gone, the group's timeout ran out) right after this rank
staged the snapshot's weights with the background copy held back: the fit must raise that error and the process exit,
not hang waiting for a copy that was never let go (in the callback's teardown, or at interpreter exit when no
teardown runs).

Usage: python agree_fail.py --dir SNAPDIR [--other-on-exception-raises] [--spawn]
One process (the failure is injected into ``LocalComm.all_true_each`` where the pipeline's stage agrees).
``--other-on-exception-raises``: another callback's ``on_exception`` raises too, so Lightning calls no other
``on_exception`` hook and no teardown (the snapshot callback's included). ``--spawn``: ``strategy="ddp_spawn"`` with
one process, whose worker runs the fit outside Lightning's exception handling (no ``on_exception``, no teardown).
Prints ``RAISED <error>`` once the fit raised, then ``END``; the process must then exit.
"""

from __future__ import annotations

import argparse
import sys
import tempfile

import lightning as L
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.demos.boring_classes import BoringModel

from lightning_snapshot import SnapshotCallback
from lightning_snapshot.backends import LocalTier
from lightning_snapshot.dist.comm import LocalComm

original = LocalComm.all_true_each


def all_true_each(self: LocalComm, flags: list[bool]) -> list[bool]:
    # (the agreement right after staging: agree.agree_on, called by the stager's stage_shared)
    if sys._getframe(2).f_code.co_name == "stage_shared":
        raise RuntimeError("injected: the other ranks did not answer within the collective timeout")
    return original(self, flags)


LocalComm.all_true_each = all_true_each  # type: ignore[method-assign]  # (at import: a spawned worker imports it)


class FailingOnException(Callback):  # (a logger's or profiler's callback whose on_exception fails)
    def on_exception(self, trainer, pl_module, exception):
        raise OSError("injected: another callback's on_exception failed")


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--dir", default=None)
    p.add_argument("--other-on-exception-raises", action="store_true")
    p.add_argument("--spawn", action="store_true")
    a = p.parse_args()
    callbacks = [SnapshotCallback(LocalTier(a.dir or tempfile.mkdtemp(), every_n_train_steps=4))]
    if a.other_on_exception_raises:
        callbacks.append(FailingOnException())
    trainer = L.Trainer(
        max_steps=8,
        callbacks=callbacks,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        accelerator="cpu",
        devices=1,
        strategy="ddp_spawn" if a.spawn else "auto",
    )
    try:
        trainer.fit(BoringModel())
    except BaseException as e:  # noqa: BLE001 - (the spawn launcher re-raises the worker's failure as its own)
        print(f"RAISED {type(e).__name__}: {str(e)[:300]}", flush=True)
    print("END", flush=True)
