"""ddp_spawn / ddp_fork: the callback and its tiers pickle (only their configuration travels), a run under either
strategy snapshots and resumes bitwise exactly; and a LightningCLI script resumes when rerun with the same command."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
from pathlib import Path

import lightning as L
import pytest
import torch
from conftest import SCRIPTS
from fingerprint import assert_same_run
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_snapshot import SnapshotCallback
from lightning_snapshot.backends import LocalTier, ObjectStoreTier, RamTier
from lightning_snapshot.persist.writer import committed_steps


def _run(
    script: str, *args: str, env: dict[str, str] | None = None, timeout: int = 300
) -> subprocess.CompletedProcess[str]:
    e = {**os.environ, "PYTHONWARNINGS": "ignore::DeprecationWarning", **(env or {})}
    return subprocess.run(
        [sys.executable, str(SCRIPTS / script), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=e,
        start_new_session=True,
    )


def _ok(proc: subprocess.CompletedProcess[str]) -> subprocess.CompletedProcess[str]:
    assert proc.returncode == 0, f"rc={proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-5000:]}"
    return proc


# ------------------------------------------------------------------------------------------- pickling
def test_callback_and_tiers_pickle_before_setup_and_work_after(tmp_path):
    secret = "s3cr3t-value-for-the-test"
    local = LocalTier(tmp_path / "local", every_n_train_steps=2, keep_last=2)
    s3 = ObjectStoreTier(
        "s3://bucket/run-1",
        storage_options={
            "key": "test-key-id",
            "secret": secret,
            "client_kwargs": {"endpoint_url": "http://127.0.0.1:9"},
        },
        every_n_train_steps=5,
        keep_last=None,
        max_pending=2,
    )
    ram = RamTier(every_n_train_steps=3, name="spawn-test", shm_dir=str(tmp_path / "shm"))
    cb = SnapshotCallback([ram, local, s3], resume=False, on_error="warn")
    local.write("warm/a.bin", [b"x"])  # the tiers were used in this process: counters, a RAM store
    ram.write("warm/b.bin", [b"y"])

    cb2 = pickle.loads(pickle.dumps(cb))

    assert cb2.resume is False and cb2.on_error == "warn" and cb2._session is None
    assert cb2.state_key == cb.state_key
    ram2, local2, s3b = cb2.tiers
    assert [type(t) for t in cb2.tiers] == [RamTier, LocalTier, ObjectStoreTier]
    for a, b in zip(cb.tiers, cb2.tiers):
        assert (b.url, b.every_n_train_steps, b.keep_last, b.spec()) == (
            a.url,
            a.every_n_train_steps,
            a.keep_last,
            a.spec(),
        )
    # the local tier: a lock and counters of its own, and it writes and reads
    assert local2.files.count_lock is not local.files.count_lock and local2.bytes_read == 0
    local2.write("step-000000000001/x.bin", [b"hello ", b"world"])
    assert local2.read("step-000000000001/x.bin") == b"hello world"
    out = bytearray(5)
    local2.read_into("step-000000000001/x.bin", 6, memoryview(out))
    assert bytes(out) == b"world" and local2.bytes_read == 5
    # the object-store tier: not connected by unpickling; its filesystem is made on first use, with the options
    assert s3b.access.fs_obj is None and s3b.max_pending == 2 and s3b.root == "bucket/run-1"
    assert secret not in s3b.url and secret not in repr(s3b)
    fs = s3b.fs
    assert type(fs).__name__ == "S3FileSystem" and fs.storage_options["secret"] == secret
    assert s3b.access.pipe_params  # what its pipe_file accepts, for this filesystem
    # the RAM tier: its node store is made again (and finds what was written)
    assert ram2.placement._store is None and ram2.name == "spawn-test" and ram2.erasure is None
    ram2.write("step-000000000003/c.bin", [b"ram bytes"])
    assert ram2.read("step-000000000003/c.bin") == b"ram bytes" and ram2.read("warm/b.bin") == b"y"


def test_object_store_tier_makes_its_filesystem_again_after_fork(tmp_path):
    tier = ObjectStoreTier("memory://ls-spawn-test/run", every_n_train_steps=1)
    tier.write("a.bin", [b"parent"])
    tier2 = pickle.loads(pickle.dumps(tier))
    tier2.write("b.bin", [b"unpickled"])
    assert tier2.read("b.bin") == b"unpickled" and tier2.access.fs_pid == os.getpid()
    parent_fs = tier.fs
    pid = os.fork()
    if pid == 0:  # the child: a filesystem object of its own (async clients such as s3fs are not fork-safe)
        ok = tier.fs is not parent_fs and tier.access.fs_pid == os.getpid()
        tier.write("c.bin", [b"child"])
        os._exit(0 if ok and tier.read("c.bin") == b"child" else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert tier.fs is parent_fs


class _Tiny(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        return self.net(batch[0]).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_callback_in_use_refuses_pickling_with_a_clear_error(tmp_path):
    snapshots = SnapshotCallback(LocalTier(tmp_path / "snaps", every_n_train_steps=2))
    errors: list[BaseException] = []

    class TryPickle(L.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if trainer.global_step == 3 and not errors:
                try:
                    pickle.dumps(snapshots)
                except TypeError as e:
                    errors.append(e)

    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=4,
        callbacks=[snapshots, TryPickle()],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(_Tiny(), DataLoader(TensorDataset(torch.randn(16, 4)), batch_size=4))
    assert len(errors) == 1 and "in use by a running fit" in str(errors[0])
    again = pickle.loads(pickle.dumps(snapshots))  # after fit: configuration only again
    assert again._session is None and again.tiers[0].url == snapshots.tiers[0].url


# ------------------------------------------------------------------------------------------- real runs
def _spawn_run(snaps: Path, out: Path, strategy: str, *args: str) -> subprocess.CompletedProcess[str]:
    return _run(
        "spawn_train.py",
        "--dir",
        str(snaps),
        "--out",
        str(out),
        "--strategy",
        strategy,
        "--max-steps",
        "10",
        "--every",
        "2",
        *args,
    )


def _load(out: Path, rank: int) -> dict:
    return torch.load(f"{out}.rank{rank}", weights_only=True)


def _assert_same_training(ref: Path, got: Path) -> None:
    """Each rank's result equal (``fingerprint.assert_same_run``: everything a resume restores)."""
    for rank in (0, 1):
        a, b = _load(ref, rank), _load(got, rank)
        assert a["global_step"] == b["global_step"] == 10
        since = b["restored_step"] if b["restored_step"] >= 0 else None
        for r in (a, b):
            del r["pid"], r["restored_step"]
        try:
            assert_same_run(a, b, since)
        except AssertionError as e:
            raise AssertionError(f"rank {rank}: {e}") from None


def _kill_and_resume(tmp_path: Path, strategy: str) -> Path:
    snaps, out = tmp_path / "snaps", tmp_path / "resumed.pt"
    killed = _spawn_run(snaps, tmp_path / "killed.pt", strategy, "--kill-at", "5")
    assert killed.returncode not in (0, -9), killed.stderr[-3000:]  # the launcher survives its worker, and fails
    assert "KILLING rank 0 at step 5" in killed.stdout
    assert "process 0 terminated with signal SIGKILL" in killed.stderr, killed.stderr[-3000:]
    assert not Path(f"{tmp_path / 'killed.pt'}.rank0").exists()
    committed = committed_steps(LocalTier(snaps))
    assert committed, "the killed run committed no snapshot"
    proc = _ok(_spawn_run(snaps, out, strategy))
    assert proc.stdout.count(f"RESTORED step={committed[0]} ") == 2, proc.stdout
    assert [_load(out, r)["restored_step"] for r in (0, 1)] == [committed[0]] * 2
    assert _load(out, 0)["pid"] != _load(out, 1)["pid"]  # (the ranks ran in worker processes of their own)
    return out


@pytest.mark.slow
def test_ddp_spawn_sigkill_rank0_and_resume_is_bitwise_exact(tmp_path):
    ref = tmp_path / "ref.pt"
    _ok(_spawn_run(tmp_path / "ref-snaps", ref, "ddp_spawn"))
    assert _load(ref, 0)["restored_step"] == -1
    assert committed_steps(LocalTier(tmp_path / "ref-snaps")) == [10, 8]
    _assert_same_training(ref, _kill_and_resume(tmp_path, "ddp_spawn"))


@pytest.mark.slow
def test_ddp_fork_sigkill_rank0_and_resume_is_bitwise_exact(tmp_path):
    ref = tmp_path / "ref.pt"
    _ok(_spawn_run(tmp_path / "ref-snaps", ref, "ddp_fork"))
    _assert_same_training(ref, _kill_and_resume(tmp_path, "ddp_fork"))


# ------------------------------------------------------------------------------------------- LightningCLI
@pytest.mark.slow
def test_lightning_cli_rerun_with_the_same_command_resumes(tmp_path):
    pytest.importorskip("jsonargparse")
    snaps, root = tmp_path / "snaps", tmp_path / "root"
    config = tmp_path / "config-in.yaml"
    config.write_text(f"""\
trainer:
  accelerator: cpu
  devices: 1
  max_steps: 8
  logger: false
  default_root_dir: {root}
  enable_progress_bar: false
  enable_model_summary: false
  callbacks:
    - class_path: lightning_snapshot.SnapshotCallback
      init_args:
        tiers: ["{snaps}?every=2&keep=2"]
""")
    command = ("cli_train.py", "fit", "--config", str(config))
    first = _run(*command, env={"LS_TEST_KILL_AT": "5"})
    assert first.returncode == -9, f"rc={first.returncode}\n{first.stderr[-3000:]}"
    assert (root / "config.yaml").is_file()  # saved by LightningCLI's SaveConfigCallback before the crash
    assert committed_steps(LocalTier(snaps))
    # without save_config_kwargs={"overwrite": True}, the rerun stops at the config.yaml the first run left
    refused = _run(*command, env={"LS_TEST_NO_OVERWRITE": "1"})
    assert refused.returncode != 0 and "config.yaml to NOT exist" in refused.stderr
    # with it, the same command resumes and finishes
    second = _ok(_run(*command))
    out = second.stdout + second.stderr
    assert "lightning-snapshot: restored step " in out, out[-3000:]
    assert committed_steps(LocalTier(snaps)) == [8, 6]
