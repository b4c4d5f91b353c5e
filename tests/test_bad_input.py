"""Bad input gets a clear error and loses nothing: corruption, bad manifests, other models, full disks."""

from __future__ import annotations

import json
import logging
import subprocess
import warnings
from pathlib import Path

import lightning as L
import pytest
from torch import nn
from torch.utils.data import DataLoader
from train import Model, Squares, Stream

from lightning_snapshot import SnapshotCallback, load_snapshot
from lightning_snapshot.backends import LocalTier
from lightning_snapshot.errors import (
    ChecksumError,
    FormatVersionError,
    ManifestError,
    SnapshotError,
    SnapshotNotFoundError,
    StateMismatchError,
    StorageFullError,
    UnsafePathError,
)
from lightning_snapshot.persist.writer import committed_steps


def fit(
    snaps: Path,
    max_steps: int,
    model: L.LightningModule | None = None,
    loader=None,
    every: int = 3,
    keep_last: int | None = 3,
    **cb_kwargs,
):
    L.seed_everything(42, verbose=False)
    model = model or Model(0.2)
    cb = SnapshotCallback(LocalTier(snaps, every_n_train_steps=every, keep_last=keep_last), **cb_kwargs)
    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=max_steps,
        callbacks=[cb],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, loader if loader is not None else DataLoader(Squares(), batch_size=4, shuffle=True))
    return trainer, cb, model


def manifest_path(snaps: Path, step: int) -> Path:
    return snaps / f"step-{step:012d}" / "manifest.json"


@pytest.fixture
def three_snapshots(tmp_path):
    snaps = tmp_path / "snaps"
    fit(snaps, 9)
    assert committed_steps(LocalTier(snaps)) == [9, 6, 3]
    return snaps


def test_corrupted_chunk_names_tensor_object_and_step_and_falls_back(three_snapshots):
    snaps = three_snapshots
    manifest = json.loads(manifest_path(snaps, 9).read_text())
    entry = manifest["tensors"][0]
    frag = entry["fragments"][0]
    data = snaps / "step-000000000009" / frag["object"]
    raw = bytearray(data.read_bytes())
    raw[frag["offset"] + 5] ^= 0xFF
    data.write_bytes(bytes(raw))

    with pytest.raises(ChecksumError) as err:
        load_snapshot(str(snaps), step=9)
    msg = str(err.value)
    assert entry["name"] in msg and frag["object"] in msg and "step 9" in msg

    with pytest.warns(UserWarning, match=r"checksum mismatch in tensor .*step 9.*Falling back"):
        trainer, cb, _ = fit(snaps, 12)
    assert cb.restored_from[1] == 6
    assert trainer.global_step == 12


def test_truncated_manifest_is_an_error_and_resume_falls_back(three_snapshots):
    path = manifest_path(three_snapshots, 9)
    path.write_bytes(path.read_bytes()[:100])
    with pytest.raises(ManifestError, match="not valid JSON"):
        load_snapshot(str(three_snapshots), step=9)
    with pytest.warns(UserWarning, match="not valid JSON"):
        _, cb, _ = fit(three_snapshots, 12)
    assert cb.restored_from[1] == 6


def test_newer_format_version_asks_for_an_upgrade(three_snapshots):
    path = manifest_path(three_snapshots, 9)
    m = json.loads(path.read_text())
    m["format_version"] = 2
    path.write_text(json.dumps(m))
    with pytest.raises(FormatVersionError, match=r"newer .*pip install -U lightning-snapshot"):
        load_snapshot(str(three_snapshots), step=9)
    with pytest.raises(FormatVersionError):  # no silent fallback to an older snapshot: that would lose progress
        fit(three_snapshots, 12)
    assert committed_steps(LocalTier(three_snapshots)) == [9, 6, 3]


class OtherModel(Model):
    def __init__(self) -> None:
        super().__init__(0.2)
        self.net[0] = nn.Linear(8, 32)  # shape mismatch
        self.net[1] = nn.BatchNorm1d(32)
        self.net[4] = nn.Linear(32, 1)
        self.extra = nn.Linear(2, 2)  # missing in the snapshot


def test_snapshot_of_a_different_model_lists_the_differences(three_snapshots):
    with pytest.raises(StateMismatchError) as err:
        fit(three_snapshots, 12, model=OtherModel())
    msg = str(err.value)
    assert "missing keys" in msg and "extra.weight" in msg
    assert "shape mismatches" in msg and "net.0.weight snapshot (16, 8) vs model (32, 8)" in msg
    assert "resume=False" in msg


def test_object_key_escaping_the_tier_root_is_refused(three_snapshots):
    path = manifest_path(three_snapshots, 9)
    m = json.loads(path.read_text())
    old = m["objects"][0]["key"]
    m["objects"][0]["key"] = "../escape.bin"
    for section in [m["tensors"]] + [r["tensors"] for r in m["ranks"]]:
        for t in section:
            for f in t.get("fragments", []):
                if f["object"] == old:
                    f["object"] = "../escape.bin"
    path.write_text(json.dumps(m))
    with pytest.raises(UnsafePathError, match="escape the tier root"):
        load_snapshot(str(three_snapshots), step=9)
    with pytest.warns(UserWarning, match="escape the tier root"):
        _, cb, _ = fit(three_snapshots, 12)
    assert cb.restored_from[1] == 6


def test_symlink_out_of_the_tier_is_refused(three_snapshots, tmp_path):
    step_dir = three_snapshots / "step-000000000009"
    victim = next(p for p in step_dir.iterdir() if "shared" in p.name)
    outside = tmp_path / "outside.bin"
    victim.rename(outside)
    victim.symlink_to(outside)
    with pytest.raises(UnsafePathError, match="outside the tier root"):
        load_snapshot(str(three_snapshots), step=9)


def test_every_snapshot_corrupt_raises_and_deletes_nothing(three_snapshots):
    for step in (3, 6, 9):
        manifest_path(three_snapshots, step).write_text("{")
    with pytest.raises(SnapshotError, match=r"no snapshot could be restored.*resume=False"):
        fit(three_snapshots, 12)
    assert sorted(p.name for p in three_snapshots.iterdir()) == [f"step-{s:012d}" for s in (3, 6, 9)]


def test_explicit_resume_by_step_and_by_path(three_snapshots):
    _, cb, _ = fit(three_snapshots, 12, resume=6, keep_last=None)
    assert cb.restored_from[1] == 6
    _, cb, _ = fit(three_snapshots, 12, resume=str(three_snapshots / "step-000000000003"), keep_last=None)
    assert cb.restored_from[1] == 3
    with pytest.raises(SnapshotNotFoundError, match="resume=99"):
        fit(three_snapshots, 12, resume=99)


def test_resume_false_starts_fresh(three_snapshots):
    trainer, cb, _ = fit(three_snapshots, 4, resume=False)
    assert cb.restored_from is None and trainer.global_step == 4


def test_restore_is_logged_in_one_line(three_snapshots, caplog):
    with caplog.at_level(logging.INFO, logger="lightning_snapshot"):
        fit(three_snapshots, 12)
    lines = [r.getMessage() for r in caplog.records if "restored step" in r.getMessage()]
    assert len(lines) == 1
    assert f"restored step 9 from the local tier {three_snapshots}" in lines[0] and " s" in lines[0]


def test_iterable_dataset_without_state_warns_once_with_the_fix(tmp_path):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit(tmp_path / "snaps", 6, loader=DataLoader(Stream(), batch_size=4))
    ours = [w for w in caught if "lightning-snapshot cannot restore the exact position" in str(w.message)]
    assert len(ours) == 1
    assert "StatefulDataLoader" in str(ours[0].message)


@pytest.fixture
def tiny_disk(tmp_path):
    mount = tmp_path / "tiny"
    mount.mkdir()
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=96k", "tmpfs", str(mount)], capture_output=True)
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here (needs root): {proc.stderr.decode().strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def _all_loadable(snaps: Path) -> list[int]:
    steps = committed_steps(LocalTier(snaps))
    for step in steps:
        load_snapshot(str(snaps), step=step, rank=0)  # verifies every chunk
    leftovers = [p.name for p in snaps.iterdir() if not (p / "manifest.json").exists()]
    assert leftovers == [], f"a failed write left {leftovers} behind"
    return steps


def test_full_disk_with_on_error_warn_keeps_training_and_earlier_snapshots(tiny_disk):
    with pytest.warns(UserWarning, match="no space left on device.*Earlier snapshots are intact"):
        trainer, _, _ = fit(tiny_disk, 10, every=1, keep_last=None, on_error="warn")
    assert trainer.global_step == 10
    steps = _all_loadable(tiny_disk)
    assert steps and steps[-1] == 1 and len(steps) < 10


def test_full_disk_with_on_error_raise_stops_with_a_clear_error(tiny_disk):
    with pytest.raises(StorageFullError, match="no space left on device"):
        fit(tiny_disk, 10, every=1, keep_last=None)
    assert _all_loadable(tiny_disk)
