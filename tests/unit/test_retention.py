"""What only the local tier does: failed re-writes (a real OSError from the filesystem) and symlinks, checked on the
files on disk. Retention, re-writes, unsafe keys and ranged reads of every tier: tests/test_backends.py."""

from __future__ import annotations

import os

import pytest
import torch

from lightning_snapshot.backends.local import LocalTier
from lightning_snapshot.dist.comm import LocalComm
from lightning_snapshot.errors import SnapshotError, SnapshotWriteError, UnsafePathError
from lightning_snapshot.format.manifest import step_dirname
from lightning_snapshot.persist.writer import SnapshotJob, committed_steps, write_snapshot
from lightning_snapshot.restore.loader import load_snapshot
from lightning_snapshot.staging import stage


def write(tier, step, *, run_id="run1", value=None):
    value = float(step) if value is None else value
    shared = {"step": step, "w": torch.full((4,), value)}
    job = SnapshotJob(step, 0, shared=stage(shared), private=stage({"r": torch.tensor([step])}, "rank"))
    return write_snapshot(tier, LocalComm(), job, run_id=run_id)


# ---------------------------------------------------------------------------------------------------- re-writes


def test_a_failed_rewrite_leaves_the_committed_step_intact(tmp_path):
    tier = LocalTier(tmp_path)
    write(tier, 3, run_id="aaa", value=1.0)
    before = sorted(os.listdir(tmp_path / step_dirname(3)))
    manifest_before = (tmp_path / step_dirname(3) / "manifest.json").read_bytes()
    # a directory where the new run's data object must go: the write fails with a real OSError
    (tmp_path / step_dirname(3) / "bbb-shared-00000.bin").mkdir()
    with pytest.raises(SnapshotWriteError):
        write(tier, 3, run_id="bbb", value=2.0)
    assert sorted(os.listdir(tmp_path / step_dirname(3))) == before
    assert (tmp_path / step_dirname(3) / "manifest.json").read_bytes() == manifest_before
    assert torch.equal(load_snapshot(str(tmp_path))["w"], torch.full((4,), 1.0))


def test_a_failed_first_write_leaves_no_step_behind(tmp_path):
    tier = LocalTier(tmp_path)
    write(tier, 1)
    (tmp_path / step_dirname(2)).mkdir()
    (tmp_path / step_dirname(2) / "run1-rank-00000.bin").mkdir()
    with pytest.raises(SnapshotError):
        write(tier, 2)
    assert committed_steps(tier) == [1]
    assert load_snapshot(str(tmp_path))["step"] == 1


# ---------------------------------------------------------------------------------------------------- path safety


@pytest.fixture
def outside(tmp_path):
    d = tmp_path / "outside"
    d.mkdir()
    (d / "secret.bin").write_bytes(b"top secret bytes")
    return d


def test_symlinked_directory_leading_out_of_the_tier_is_refused(tmp_path, outside):
    root = tmp_path / "tier"
    root.mkdir()
    tier = LocalTier(root)
    os.symlink(outside, root / step_dirname(1))
    with pytest.raises(UnsafePathError):
        tier.read(f"{step_dirname(1)}/secret.bin")
    buf = bytearray(4)
    with pytest.raises(UnsafePathError):
        tier.read_into(f"{step_dirname(1)}/secret.bin", 0, memoryview(buf))
    assert buf == bytearray(4)


def test_symlinked_file_leading_out_of_the_tier_is_refused(tmp_path, outside):
    root = tmp_path / "tier"
    (root / step_dirname(1)).mkdir(parents=True)
    tier = LocalTier(root)
    os.symlink(outside / "secret.bin", root / step_dirname(1) / "data.bin")
    with pytest.raises(UnsafePathError):
        tier.read(f"{step_dirname(1)}/data.bin")
    with pytest.raises(UnsafePathError):
        tier.read_into(f"{step_dirname(1)}/data.bin", 4, memoryview(bytearray(3)))


def test_symlink_inside_the_tier_is_fine(tmp_path):
    root = tmp_path / "tier"
    (root / "real").mkdir(parents=True)
    (root / "real" / "a.bin").write_bytes(b"0123456789")
    os.symlink(root / "real", root / "link")
    tier = LocalTier(root)
    assert tier.read("link/a.bin") == b"0123456789"
    buf = bytearray(3)
    tier.read_into("link/a.bin", 4, memoryview(buf))
    assert bytes(buf) == b"456"
