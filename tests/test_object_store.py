"""The object-store tier against moto's real S3 server on 127.0.0.1 (never a mocked s3fs)."""

from __future__ import annotations

import logging
import shutil
import subprocess
import sys
import time
import warnings

import lightning as L
import pytest
import torch
from conftest import SCRIPTS, assert_bitwise_equal, assert_resumed, run_train
from torch.utils.data import DataLoader
from train import Model, Squares, s3_options

from lightning_snapshot import SnapshotCallback, load_snapshot
from lightning_snapshot.backends import LocalTier, ObjectStoreTier
from lightning_snapshot.dist.comm import LocalComm
from lightning_snapshot.errors import SnapshotNotFoundError, SnapshotWriteError, TierUnavailableError
from lightning_snapshot.persist.writer import SnapshotJob, apply_retention, committed_steps, write_snapshot
from lightning_snapshot.restore.loader import read_manifest
from lightning_snapshot.staging import stage


def s3_tier(server, bucket, prefix="run", options=None, **kw) -> ObjectStoreTier:
    return ObjectStoreTier(f"s3://{bucket}/{prefix}", storage_options=options or s3_options(server.endpoint), **kw)


class Recorder(L.pytorch.loggers.Logger):
    name, version = "rec", 0

    def __init__(self):
        super().__init__()
        self.metrics: list[tuple[int, dict]] = []

    def log_metrics(self, metrics, step=None):
        self.metrics.append((step, dict(metrics)))

    def log_hyperparams(self, *a, **k):
        pass

    def values(self, name):
        return [(s, m[name]) for s, m in self.metrics if name in m]


@pytest.mark.slow
def test_restore_from_the_object_store_alone_is_bitwise_identical(tmp_path, s3_server, bucket, reference_runs):
    args = ("--shuffle", "--dropout", "0.2")
    s3 = ("--s3", f"s3://{bucket}/run", "--endpoint", s3_server.endpoint)
    snaps = tmp_path / "snaps"
    run_train(snaps, tmp_path / "crashed.pt", *args, *s3, "--crash-at", "11", expect_kill=True)
    committed = committed_steps(s3_tier(s3_server, bucket))
    assert committed
    shutil.rmtree(snaps)  # the local tier is gone: only the bucket is left
    proc = run_train(snaps, tmp_path / "resumed.pt", *args, *s3)
    assert_resumed(proc, committed[0], f"s3://{bucket}/run")
    assert_bitwise_equal(reference_runs(*args), tmp_path / "resumed.pt", since=committed[0])


def fast_failing(server) -> dict:
    """Client options for tests that stop the server: fail fast instead of botocore's long retries."""
    options = s3_options(server.endpoint)
    options["config_kwargs"] = {"connect_timeout": 1, "read_timeout": 2, "retries": {"max_attempts": 1}}
    return options


def test_outage_never_stalls_training_and_uploads_resume(tmp_path, s3_server, bucket):
    local = LocalTier(tmp_path / "local", every_n_train_steps=1, keep_last=None)
    remote = s3_tier(
        s3_server,
        bucket,
        options=fast_failing(s3_server),
        every_n_train_steps=1,
        keep_last=None,
        retry_initial=0.05,
        retry_max=0.2,
        drain_timeout=60,
    )

    class Outage(L.Callback):
        """The server goes away at step 4 and comes back at step 12; a step takes at least 0.1 s."""

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            time.sleep(0.1)
            if trainer.global_step == 4:
                s3_server.stop()
            if trainer.global_step == 12:
                s3_server.start()

    rec = Recorder()
    L.seed_everything(0, verbose=False)
    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=20,
        callbacks=[SnapshotCallback([local, remote]), Outage()],
        logger=rec,
        log_every_n_steps=1,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(Model(0.2), DataLoader(Squares(), batch_size=4))
    assert trainer.global_step == 20
    assert committed_steps(local) == list(range(20, 0, -1))  # the fast tier never missed a step
    uploaded = committed_steps(remote)
    assert uploaded[0] == 20 and any(s > 12 for s in uploaded), uploaded  # uploads resumed on their own
    assert len(uploaded) < 20  # pending uploads were bounded: some steps skipped for the bucket
    assert rec.values("snapshot/s3/skipped")[-1][1] == 20 - len(uploaded)
    assert max(v for _, v in rec.values("snapshot/s3/lag_steps")) >= 4  # the gap grew during the outage
    # nothing half-uploaded is visible: every prefix without a manifest is not a snapshot for the loader
    for name in remote.list(""):
        step = int(name.split("-")[1])
        if step in uploaded:
            load_snapshot(remote, step=step, rank=0)  # verifies every chunk
        else:
            with pytest.raises(SnapshotNotFoundError):
                load_snapshot(remote, step=step)


_CRASH_SCRIPT = """
import os, signal, sys, torch
sys.path.insert(0, {scripts!r})
from train import s3_options
from lightning_snapshot.backends import ObjectStoreTier
from lightning_snapshot.dist.comm import LocalComm
from lightning_snapshot.staging import stage
from lightning_snapshot.persist.writer import SnapshotJob, write_snapshot
tier = ObjectStoreTier({url!r}, storage_options=s3_options({endpoint!r}), part_size=5 << 20)
state = {{"w": torch.arange(4_000_000, dtype=torch.float32)}}  # 16 MB: a multipart upload
write_snapshot(tier, LocalComm(), SnapshotJob(5, 0, stage(state), stage({{}}, "rank")), "run1")
write_snapshot(tier, LocalComm(), SnapshotJob(7, 0, stage(state), stage({{}}, "rank")), "run1",
               before_commit=lambda: os.kill(os.getpid(), signal.SIGKILL))
"""


def test_crash_between_upload_and_manifest_leaves_the_step_invisible(s3_server, bucket):
    url = f"s3://{bucket}/run"
    code = _CRASH_SCRIPT.format(scripts=str(SCRIPTS), url=url, endpoint=s3_server.endpoint)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == -9, proc.stderr[-2000:]
    tier = s3_tier(s3_server, bucket, keep_last=1)
    assert committed_steps(tier) == [5]
    assert any(n.endswith(".bin") for n in tier.list("step-000000000007"))  # the data did arrive
    with pytest.raises(SnapshotNotFoundError):
        load_snapshot(tier, step=7)
    assert load_snapshot(url.replace("s3://", "s3://"), step=5) if False else load_snapshot(tier)["w"].numel() == 4e6
    # a later commit: retention drops the half-uploaded step and keeps only the newest verified one
    write_snapshot(tier, LocalComm(), SnapshotJob(9, 0, stage({"w": 1}), stage({}, "rank")), "run2")
    apply_retention(tier, 9)
    assert tier.list("") == ["step-000000000009"]


def test_incomplete_multipart_uploads_are_aborted(s3_server, bucket):
    import boto3

    client = boto3.client(
        "s3",
        endpoint_url=s3_server.endpoint,
        aws_access_key_id="testing-key",
        aws_secret_access_key="testing-secret",
        region_name="us-east-1",
    )
    client.create_multipart_upload(Bucket=bucket, Key="run/step-000000000001/x.bin")
    tier = s3_tier(s3_server, bucket)
    assert tier.abort_incomplete_uploads() == 1
    assert client.list_multipart_uploads(Bucket=bucket).get("Uploads", []) == []


def test_a_secret_never_appears_in_logs_or_errors(tmp_path, caplog):
    secret, key_id = "S3cr3t-Value-Never-Shown-123", "AKIAQWERTYSECRETID"
    dead = {
        "key": key_id,
        "secret": secret,
        "client_kwargs": {"endpoint_url": "http://127.0.0.1:9", "region_name": "us-east-1"},
        "config_kwargs": {"connect_timeout": 1, "retries": {"max_attempts": 1}},
    }
    remote = ObjectStoreTier(
        "s3://bucket-x/run",
        storage_options=dead,
        every_n_train_steps=2,
        retry_initial=0.05,
        retry_max=0.1,
        drain_timeout=1,
    )
    texts = [repr(remote), remote.url]
    with pytest.raises(SnapshotWriteError) as err:
        remote.write("step-000000000001/x.bin", [b"abc"])
    texts.append(str(err.value))
    caplog.set_level(logging.DEBUG)
    L.seed_everything(0, verbose=False)
    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=4,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[SnapshotCallback([LocalTier(tmp_path, every_n_train_steps=2), remote])],
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(TierUnavailableError) as setup_err:  # checked at setup: training does not start
            trainer.fit(Model(0.2), DataLoader(Squares(), batch_size=4))
    texts += [str(w.message) for w in caught] + [str(setup_err.value), str(setup_err.value.__cause__)]
    ours = [r.getMessage() + str(r.exc_info or "") for r in caplog.records if r.name.startswith("lightning_snapshot")]
    everything = [r.getMessage() + str(r.exc_info or "") for r in caplog.records]  # botocore's DEBUG too
    assert "endpoint does not answer" in str(setup_err.value), "the unreachable endpoint was not reported"
    assert [t for t in texts + ours if secret in t or key_id in t] == []
    # the secret itself appears nowhere, not even in third-party debug logs (botocore logs the access key id in
    # its signed request headers at DEBUG level, which is not ours to change)
    assert [t for t in everything if secret in t] == []


def test_a_retried_write_whose_first_manifest_commit_landed_succeeds(s3_server, bucket):
    """A write retried after its manifest commit landed but the answer was lost: the retry writes the same data and
    a manifest that differs only in its creation time; the committed one stands (no 'already committed' error). Other
    data at the same step is still refused: a committed snapshot is never overwritten."""
    tier = s3_tier(s3_server, bucket)
    state = {"w": torch.arange(1000, dtype=torch.float32)}
    first = write_snapshot(tier, LocalComm(), SnapshotJob(4, 0, stage(state), stage({}, "rank")), "run")
    time.sleep(0.01)  # (another creation time)
    again = write_snapshot(tier, LocalComm(), SnapshotJob(4, 0, stage(state), stage({}, "rank")), "run")
    assert again.created_unix != first.created_unix
    assert read_manifest(tier, 4).created_unix == first.created_unix  # the committed manifest was kept
    assert torch.equal(load_snapshot(tier, step=4)["w"], state["w"])
    with pytest.raises(SnapshotWriteError, match="already committed"):
        write_snapshot(tier, LocalComm(), SnapshotJob(4, 0, stage({"w": torch.zeros(1000)}), stage({}, "rank")), "run")
