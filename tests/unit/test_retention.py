"""Retention, re-writes and path safety of the local tier, checked on the files on disk."""

from __future__ import annotations

import os

import pytest
import torch

from lightning_snapshot.backends.local import LocalTier
from lightning_snapshot.comm import LocalComm
from lightning_snapshot.errors import SnapshotError, SnapshotWriteError, UnsafePathError
from lightning_snapshot.loader import load_snapshot
from lightning_snapshot.manifest import step_dirname
from lightning_snapshot.staging import stage
from lightning_snapshot.writer import SnapshotJob, apply_retention, committed_steps, write_snapshot


def write(tier, step, *, run_id="run1", value=None):
    value = float(step) if value is None else value
    shared = {"step": step, "w": torch.full((4,), value)}
    job = SnapshotJob(step, 0, shared=stage(shared), private=stage({"r": torch.tensor([step])}, "rank"))
    return write_snapshot(tier, LocalComm(), job, run_id=run_id)


def step_dirs(root) -> list[str]:
    return sorted(p for p in os.listdir(root) if p.startswith("step-"))


def names(*steps) -> list[str]:
    return sorted(step_dirname(s) for s in steps)


# ---------------------------------------------------------------------------------------------------- keep_last


def test_keep_last_two_keeps_the_two_newest(tmp_path):
    tier = LocalTier(tmp_path, keep_last=2)
    deleted = []
    for step in range(1, 6):
        write(tier, step)
        deleted.append(apply_retention(tier, step))
    assert deleted == [[], [], [1], [2], [3]]
    assert step_dirs(tmp_path) == names(4, 5)
    assert committed_steps(tier) == [5, 4]
    assert load_snapshot(str(tmp_path))["step"] == 5
    assert torch.equal(load_snapshot(str(tmp_path), step=4)["w"], torch.full((4,), 4.0))


def test_keep_all(tmp_path):
    tier = LocalTier(tmp_path, keep_last=None)
    for step in (10, 20, 30):
        write(tier, step)
        assert apply_retention(tier, step) == []
    assert step_dirs(tmp_path) == names(10, 20, 30)


def test_keep_last_one(tmp_path):
    tier = LocalTier(tmp_path, keep_last=1)
    for step in (1, 2, 3):
        write(tier, step)
        apply_retention(tier, step)
        assert step_dirs(tmp_path) == names(step)


def test_uncommitted_leftover_is_removed_once_a_newer_step_commits(tmp_path):
    tier = LocalTier(tmp_path, keep_last=10)
    write(tier, 1)
    write(tier, 2)
    leftover = tmp_path / step_dirname(3)
    leftover.mkdir()
    (leftover / "deadbeef-shared-00000.bin").write_bytes(b"\0" * 1000)  # a crashed write: data, no manifest
    assert committed_steps(tier) == [2, 1]
    assert apply_retention(tier, 2) == []  # older than nothing committed yet: kept
    assert leftover.exists()
    write(tier, 4)
    assert apply_retention(tier, 4) == [3]
    assert not leftover.exists()
    assert step_dirs(tmp_path) == names(1, 2, 4)


def test_uncommitted_directory_newer_than_the_new_step_is_left_alone(tmp_path):
    # it may be another writer's step in flight; retention only removes leftovers older than what it just committed
    tier = LocalTier(tmp_path, keep_last=1)
    future = tmp_path / step_dirname(7)
    future.mkdir()
    (future / "other-rank-00000.bin").write_bytes(b"x")
    write(tier, 5)
    assert apply_retention(tier, 5) == []
    assert future.exists()
    assert step_dirs(tmp_path) == names(5, 7)


def test_the_step_just_written_is_never_deleted_even_when_newer_steps_exist(tmp_path):
    tier = LocalTier(tmp_path, keep_last=None)
    write(tier, 9, run_id="old")
    write(tier, 8, run_id="old")
    tier = LocalTier(tmp_path, keep_last=1)
    write(tier, 5, run_id="new")  # e.g. a run resumed from an earlier snapshot
    deleted = apply_retention(tier, 5)
    # keep_last=1 keeps the newest committed step (9); step 5 is kept because it was just written; 8 goes
    assert deleted == [8]
    assert step_dirs(tmp_path) == names(5, 9)
    assert load_snapshot(str(tmp_path), step=5)["step"] == 5
    assert load_snapshot(str(tmp_path))["step"] == 9


def test_retention_ignores_foreign_entries(tmp_path):
    tier = LocalTier(tmp_path, keep_last=1)
    (tmp_path / "notes.txt").write_text("mine")
    (tmp_path / "step-12").mkdir()  # not a snapshot directory name
    (tmp_path / "step-000000000001.bak").mkdir()
    for step in (1, 2):
        write(tier, step)
        apply_retention(tier, step)
    assert sorted(os.listdir(tmp_path)) == sorted(["notes.txt", "step-12", "step-000000000001.bak", step_dirname(2)])


# ---------------------------------------------------------------------------------------------------- re-writes


def test_rewriting_a_committed_step_with_another_run_replaces_it(tmp_path):
    tier = LocalTier(tmp_path)
    first = write(tier, 3, run_id="aaa", value=1.0)
    assert sorted(o.key for o in first.objects) == ["aaa-rank-00000.bin", "aaa-shared-00000.bin"]
    second = write(tier, 3, run_id="bbb", value=2.0)
    assert sorted(os.listdir(tmp_path / step_dirname(3))) == [
        "bbb-rank-00000.bin", "bbb-shared-00000.bin", "manifest.json"]
    assert sorted(o.key for o in second.objects) == ["bbb-rank-00000.bin", "bbb-shared-00000.bin"]
    out = load_snapshot(str(tmp_path), rank=0)
    assert torch.equal(out["w"], torch.full((4,), 2.0))
    assert torch.equal(out["rank_state"]["r"], torch.tensor([3]))


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


def test_commit_leaves_no_temporary_files(tmp_path):
    tier = LocalTier(tmp_path)
    write(tier, 1)
    write(tier, 1, run_id="run2")
    assert [n for n in os.listdir(tmp_path / step_dirname(1)) if n.startswith(".")] == []


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


@pytest.mark.parametrize("key", ["../outside/secret.bin", "/etc/passwd", "a/../../x", "", "a//b", "a\\b"])
def test_keys_that_escape_the_root_are_refused(tmp_path, outside, key):
    tier = LocalTier(tmp_path / "tier")
    with pytest.raises(UnsafePathError):
        tier.read(key)
    with pytest.raises(UnsafePathError):
        tier.write(key, [b"x"])
    with pytest.raises(UnsafePathError):
        tier.delete(key)
    assert (outside / "secret.bin").read_bytes() == b"top secret bytes"


def test_read_into_past_the_end_raises_eof(tmp_path):
    tier = LocalTier(tmp_path)
    tier.write("k/obj.bin", [b"abc", memoryview(b"def")])
    with pytest.raises(EOFError):
        tier.read_into("k/obj.bin", 4, memoryview(bytearray(3)))
    with pytest.raises(FileNotFoundError):
        tier.read("k/missing.bin")
