"""Durable tiers that fail are loud: checked before training, retried with backoff, and never silently lost.

Real components only: moto's S3 server on 127.0.0.1 (the session's, or one of the test's own that it stops and
starts), a closed port for an endpoint that refuses connections, real training subprocesses where the exit status
matters.
"""

from __future__ import annotations

import csv
import signal
import socket
import subprocess
import sys
import time
import warnings
from pathlib import Path

import lightning as L
import pytest
from conftest import SCRIPTS, S3Server, run_script
from torch.utils.data import DataLoader
from train import Model, Squares, s3_options

from lightning_snapshot import SnapshotCallback, load_snapshot
from lightning_snapshot.backends import LocalTier, ObjectStoreTier
from lightning_snapshot.errors import TierUnavailableError
from lightning_snapshot.persist.writer import committed_steps

SECRET = "testing-secret"  # (train.py's s3_options)


def closed_port() -> int:
    """A port on 127.0.0.1 nothing listens on (bound, then closed): connections to it are refused."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def fit(tiers, max_steps: int = 4, callbacks=(), **kw):
    L.seed_everything(0, verbose=False)
    cb = SnapshotCallback(tiers, **kw)
    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=max_steps,
        callbacks=[*callbacks, cb],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(Model(0.0), DataLoader(Squares(), batch_size=4))
    return trainer, cb


# ------------------------------------------------------------------------------------------- at setup
@pytest.mark.slow
def test_a_bucket_that_does_not_exist_stops_the_run_before_training(tmp_path, s3_server):
    proc = run_script(
        "train.py",
        "--dir",
        str(tmp_path / "unused"),
        "--out",
        str(tmp_path / "out.pt"),
        "--no-local",
        "--s3",
        "s3://no-such-bucket/run",
        "--endpoint",
        s3_server.endpoint,
        expect_rc=1,
        timeout=300,
    )
    assert "TierUnavailableError" in proc.stderr
    assert (
        "the s3 tier 's3://no-such-bucket/run': bucket 'no-such-bucket' does not exist" in proc.stderr
        and "aws s3 mb s3://no-such-bucket" in proc.stderr
    ), proc.stderr[-3000:]
    assert "training does not start" in proc.stderr
    assert not (tmp_path / "out.pt").exists()  # fit raised: no training result
    assert SECRET not in proc.stderr + proc.stdout


@pytest.mark.slow
def test_an_endpoint_that_refuses_connections_stops_the_run_before_training(tmp_path):
    port = closed_port()
    proc = run_script(
        "train.py",
        "--dir",
        str(tmp_path / "unused"),
        "--out",
        str(tmp_path / "out.pt"),
        "--no-local",
        "--s3",
        "s3://bucket/run",
        "--endpoint",
        f"http://127.0.0.1:{port}",
        expect_rc=1,
        timeout=300,
    )
    err = proc.stderr
    assert "TierUnavailableError" in err and "training does not start" in err, err[-3000:]
    assert "the s3 tier 's3://bucket/run': endpoint does not answer" in err
    assert f"127.0.0.1:{port}" in err and "endpoint_url" in err  # where it tried, and the option to fix
    assert "EndpointConnectionError: Could not connect" in err  # translated, with the cause kept
    assert not (tmp_path / "out.pt").exists()
    assert SECRET not in err + proc.stdout


@pytest.mark.slow
def test_under_ddp_every_rank_stops_with_the_same_error(tmp_path, s3_server):
    proc = run_script(
        "train.py",
        "--dir",
        str(tmp_path / "unused"),
        "--out",
        str(tmp_path / "out.pt"),
        "--no-local",
        "--devices",
        "2",
        "--s3",
        "s3://no-such-bucket-ddp/run",
        "--endpoint",
        s3_server.endpoint,
        expect_rc=1,
        timeout=300,
    )
    error = "lightning_snapshot.errors.TierUnavailableError: "
    lines = [line.split("]: ", 1)[-1] for line in proc.stderr.splitlines() if error in line]
    # both ranks raised (rank 1 is a child of rank 0 and shares its stderr), with the same text naming both ranks
    assert len(lines) == 2 and lines[0] == lines[1], proc.stderr[-4000:]
    assert (
        "on ranks 0, 1: the s3 tier 's3://no-such-bucket-ddp/run': bucket 'no-such-bucket-ddp' does not exist"
        in lines[0]
    ), lines[0]


def test_a_local_tier_under_a_file_stops_the_run_before_training(tmp_path):
    (tmp_path / "a-file").write_text("not a directory")
    with pytest.raises(TierUnavailableError) as err:
        fit([LocalTier(tmp_path / "a-file" / "snaps", every_n_train_steps=2)])
    msg = str(err.value)
    assert f"the local tier {str(tmp_path / 'a-file' / 'snaps')!r} cannot be written" in msg
    assert "Not a directory" in msg and "no part of the path is a file" in msg
    assert "training does not start" in msg


# ------------------------------------------------------------------------------------------- at resume
class _BreakAtFitStart(L.Callback):
    """Runs its action at on_fit_start, after the tiers were checked at setup and before the snapshot callback
    lists them to resume (Lightning runs checkpoint callbacks last)."""

    def __init__(self, action) -> None:
        self.action = action

    def on_fit_start(self, trainer, pl_module):
        self.action()


def test_a_local_tier_that_cannot_be_listed_at_resume_is_an_error(tmp_path):
    snaps = tmp_path / "snaps"
    fit([LocalTier(snaps, every_n_train_steps=2)])
    assert committed_steps(LocalTier(snaps)) == [4, 2]

    def replace_with_a_file():  # the directory is moved away and a file takes its place
        snaps.rename(tmp_path / "moved")
        snaps.write_text("not a directory")

    with pytest.raises(TierUnavailableError) as err:
        fit([LocalTier(snaps, every_n_train_steps=2)], max_steps=6, callbacks=[_BreakAtFitStart(replace_with_a_file)])
    msg = str(err.value)
    assert f"cannot list the local tier {str(snaps)!r} to resume from it" in msg and "Not a directory" in msg
    assert "pass resume=False to start fresh" in msg
    assert committed_steps(LocalTier(tmp_path / "moved")) == [4, 2]  # nothing was touched


def test_an_object_store_outage_at_resume_is_an_error_not_a_fresh_start(tmp_path):
    server = S3Server()  # this test's own: it stops it
    try:
        server.create_bucket("resume-outage")
        options = s3_options(server.endpoint)
        options["config_kwargs"] = {"connect_timeout": 1, "read_timeout": 5, "retries": {"max_attempts": 1}}

        def tier():
            return ObjectStoreTier("s3://resume-outage/run", storage_options=options, every_n_train_steps=2)

        fit([tier()])
        assert committed_steps(tier()) == [4, 2]
        with pytest.raises(TierUnavailableError) as err:
            fit([tier()], max_steps=6, callbacks=[_BreakAtFitStart(server.stop)])
        msg = str(err.value)
        assert "cannot list the s3 tier 's3://resume-outage/run' to resume from it" in msg
        assert "endpoint does not answer" in msg and "pass resume=False to start fresh" in msg
        assert SECRET not in msg
        server.start()
        assert committed_steps(tier()) == [4, 2]  # nothing was overwritten or deleted
    finally:
        server.stop()


# ------------------------------------------------------------------------------------------- during training
def _run_with_outage(tmp_path: Path, server: S3Server, bucket: str, *args: str) -> subprocess.Popen[str]:
    signals = tmp_path / "signals"
    signals.mkdir()
    cmd = [
        sys.executable,
        str(SCRIPTS / "durable_train.py"),
        "--s3",
        f"s3://{bucket}/run",
        "--endpoint",
        server.endpoint,
        "--logs",
        str(tmp_path / "logs"),
        "--signals",
        str(signals),
        *args,
    ]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)


def _serve(
    proc: subprocess.Popen[str], signals: Path, server: S3Server, restart: bool, timeout: float = 240
) -> tuple[str, str]:
    """Answer the run's requests: stop the server when asked, start it again when asked (``restart``)."""
    deadline = time.monotonic() + timeout
    stopped = started = False
    while proc.poll() is None and time.monotonic() < deadline:
        if not stopped and (signals / "stop").exists():
            server.stop()
            stopped = True
            (signals / "stopped").touch()
        if restart and not started and (signals / "start").exists():
            server.start()
            started = True
            (signals / "started").touch()
        time.sleep(0.05)
    if proc.poll() is None:  # hung: show where before killing it
        proc.send_signal(signal.SIGUSR1)
        time.sleep(2)
        proc.kill()
    out, err = proc.communicate(timeout=60)
    assert stopped, f"the run never asked for the outage\n{err[-3000:]}"
    return out, err


def _metric(logs: Path, name: str) -> list[float]:
    with open(logs / "metrics.csv") as f:
        return [float(row[name]) for row in csv.DictReader(f) if row.get(name)]


@pytest.mark.slow
def test_a_server_stopped_and_restarted_mid_run_is_retried_and_nothing_is_lost(tmp_path):
    server = S3Server()
    try:
        server.create_bucket("restart")
        # the bucket tier copies the local tier's files, so the staging memory is free while uploads wait, and
        # its queue has room for every snapshot of the run: none is skipped
        proc = _run_with_outage(
            tmp_path,
            server,
            "restart",
            "--max-steps",
            "12",
            "--every",
            "2",
            "--outage-at",
            "4",
            "--back-at",
            "9",
            "--local",
            str(tmp_path / "local"),
            "--max-pending",
            "12",
        )
        out, err = _serve(proc, tmp_path / "signals", server, restart=True)
        assert proc.returncode == 0, err[-4000:]
        assert "FIT DONE step=12" in out
        tier = ObjectStoreTier("s3://restart/run", storage_options=s3_options(server.endpoint))
        # every scheduled snapshot landed, those due during the outage included, and each one loads and verifies
        assert committed_steps(tier) == [12, 10, 8, 6, 4, 2]
        for step in (4, 6, 8, 12):
            assert load_snapshot(tier, step=step, rank=0)
        assert err.count("is failing") == 1, err[-4000:]  # one warning per outage, not one per retry
        assert "is back after" in err
        logs = tmp_path / "logs"
        assert max(_metric(logs, "snapshot/s3/retries")) >= 1
        assert max(_metric(logs, "snapshot/s3/lag_steps")) >= 4  # the gap grew during the outage ...
        assert _metric(logs, "snapshot/s3/lag_steps")[-1] == 0  # ... and closed
    finally:
        server.stop()


@pytest.mark.slow
def test_a_server_stopped_for_good_ends_the_run_with_an_error(tmp_path):
    server = S3Server()
    try:
        server.create_bucket("gone")
        proc = _run_with_outage(
            tmp_path, server, "gone", "--max-steps", "8", "--every", "2", "--outage-at", "4", "--drain-timeout", "3"
        )
        out, err = _serve(proc, tmp_path / "signals", server, restart=False)
        assert proc.returncode == 1, out + err[-4000:]
        assert "FIT DONE" not in out
        assert "lightning_snapshot.errors.NotDurableError" in err, err[-4000:]
        msg = err[err.index("lightning_snapshot.errors.NotDurableError") :]
        assert "the last snapshot of this fit (step 8) is not durable: no durable tier holds it" in msg
        assert "the s3 tier 's3://gone/run': " in msg and "endpoint does not answer" in msg, msg
        assert SECRET not in err + out
        assert "held by" not in err  # no line claims that some tier holds it
    finally:
        server.stop()
