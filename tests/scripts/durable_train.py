"""Training run with an object-store tier whose server a test stops and starts (tests/test_durable.py).

Usage: python durable_train.py --s3 s3://BUCKET/PREFIX --endpoint URL --logs DIR [--local DIR] [--max-steps N]
       [--every K] [--outage-at S] [--back-at S] [--signals DIR] [--drain-timeout T] [--max-pending N]

With ``--outage-at S`` the run asks the test to stop the server after step S (it writes SIGNALS/stop and waits,
at most 120 s, for SIGNALS/stopped). With ``--back-at S`` it asks for the server to be started again after step S,
once the tier has reported its outage (the "is failing" log line), in the same way (SIGNALS/start, SIGNALS/started).
Metrics go to a CSVLogger in --logs. Exits non-zero when fit raises.
"""

from __future__ import annotations

import argparse
import faulthandler
import logging
import signal
import time
from pathlib import Path

import lightning as L
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader
from train import Model, Squares, s3_options

from lightning_snapshot import SnapshotCallback
from lightning_snapshot.backends import LocalTier, ObjectStoreTier

WAIT_S = 120.0


class _Seen(logging.Handler):
    """Remembers whether the persist thread logged the outage warning."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.failing = False

    def emit(self, record: logging.LogRecord) -> None:
        if "is failing" in record.getMessage():
            self.failing = True


def _ask(signals: Path, request: str, answer: str) -> None:
    (signals / request).touch()
    deadline = time.monotonic() + WAIT_S
    while not (signals / answer).exists():
        if time.monotonic() > deadline:
            raise SystemExit(f"the test did not answer {request!r} within {WAIT_S:.0f} s")
        time.sleep(0.05)


class Outage(L.Callback):
    def __init__(self, signals: Path, at: int, back: int, seen: _Seen) -> None:
        self.signals, self.at, self.back, self.seen = signals, at, back, seen

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        step = trainer.global_step
        if step == self.at:
            _ask(self.signals, "stop", "stopped")
        if step == self.back:
            deadline = time.monotonic() + WAIT_S
            while not self.seen.failing and time.monotonic() < deadline:
                time.sleep(0.05)
            _ask(self.signals, "start", "started")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--s3", required=True)
    p.add_argument("--endpoint", required=True)
    p.add_argument("--logs", required=True)
    p.add_argument("--local", default=None)
    p.add_argument("--max-steps", type=int, default=12)
    p.add_argument("--every", type=int, default=2)
    p.add_argument("--outage-at", type=int, default=-1)
    p.add_argument("--back-at", type=int, default=-1)
    p.add_argument("--signals", default=None)
    p.add_argument("--drain-timeout", type=float, default=60.0)
    p.add_argument("--max-pending", type=int, default=1)
    a = p.parse_args()

    faulthandler.register(signal.SIGUSR1)  # (the test dumps the threads' stacks before it kills a run that hangs)
    logging.basicConfig(level=logging.WARNING)
    logging.getLogger("lightning_snapshot").setLevel(logging.INFO)
    seen = _Seen()
    logging.getLogger("lightning_snapshot").addHandler(seen)
    options = s3_options(a.endpoint)
    # fail each attempt fast while the server is down (the tier's own backoff does the retrying)
    options["config_kwargs"] = {"connect_timeout": 1, "read_timeout": 5, "retries": {"max_attempts": 1}}
    tiers = [
        ObjectStoreTier(
            a.s3,
            storage_options=options,
            every_n_train_steps=a.every,
            keep_last=None,
            max_pending=a.max_pending,
            retry_initial=0.05,
            retry_max=0.5,
            drain_timeout=a.drain_timeout,
        )
    ]
    if a.local:
        tiers.insert(0, LocalTier(a.local, every_n_train_steps=a.every, keep_last=None))
    callbacks: list[L.Callback] = [SnapshotCallback(tiers)]
    if a.outage_at >= 0:
        callbacks.append(Outage(Path(a.signals), a.outage_at, a.back_at, seen))
    L.seed_everything(42, verbose=False)
    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=a.max_steps,
        callbacks=callbacks,
        logger=CSVLogger(a.logs, name="", version=""),
        log_every_n_steps=1,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(Model(0.0), DataLoader(Squares(), batch_size=4))
    print(f"FIT DONE step={trainer.global_step}", flush=True)


if __name__ == "__main__":
    main()
