"""RAM tier restore in one process: an erasure-coded object is read straight from its data shares, a lost or
corrupted data share is rebuilt from parity, and finish_restore frees what the restore added."""

from __future__ import annotations

import json
import os

import pytest
import torch

from lightning_snapshot.backends import RamTier
from lightning_snapshot.backends.ram import shares as ram_shares
from lightning_snapshot.dist.comm import LocalComm
from lightning_snapshot.errors import SnapshotError
from lightning_snapshot.format.manifest import step_dirname
from lightning_snapshot.persist.writer import SnapshotJob, write_snapshot
from lightning_snapshot.restore.loader import read_manifest, read_section
from lightning_snapshot.staging import stage

K, M = 4, 2


def _tier(tmp_path) -> RamTier:
    ram = RamTier(every_n_train_steps=1, keep_last=None, erasure=(K, M), name="t", shm_dir=str(tmp_path), threads=2)
    ram.bind(node_rank=0, num_nodes=K + M, local_rank=0, ranks_per_node=1, default_name="t")

    # one process: every share stays on this "node" (distribute() would send shares 1..5 to nodes 1..5 over gloo)
    ram.distribute = lambda comm, prefix, run_id: ram._place_all_here()
    return ram


def _restore(ram: RamTier, targets=None):
    def read():
        manifest = read_manifest(ram, 1)
        return read_section(ram, manifest, manifest.tensors, manifest.state, targets)

    return ram.restore(LocalComm(), 1, read)


@pytest.fixture
def saved(tmp_path):
    g = torch.Generator().manual_seed(0)
    # odd sizes: the object does not fill its last stripe
    state = {
        "w": torch.randn(3 << 18, generator=g),
        "b": torch.randn(1001, generator=g),
        "i": torch.arange(77, dtype=torch.int64),
    }
    ram = _tier(tmp_path)
    write_snapshot(ram, LocalComm(), SnapshotJob(1, 0, stage(state, "shared"), stage({}, "rank")), "run")
    ec_dir = ram.store.files.path(f"{step_dirname(1)}/run-shared-00000.bin.ec")
    return ram, state, ec_dir


def _check(got, state):
    flat = got
    while set(state) - set(flat):
        flat = next(v for v in flat.values() if isinstance(v, dict))
    for name, t in state.items():
        assert torch.equal(flat[name], t), name


def test_all_shares_local_reads_the_data_shares_without_rebuilding(saved):
    ram, state, ec_dir = saved
    ram.prepare_restore(LocalComm(), 1)
    reading = json.loads((ec_dir / "reading.json").read_text())
    assert reading["files"] == ["0", "1", "2", "3"]  # no whole object, no rebuilt share
    assert not ram.store.files.path(f"{step_dirname(1)}/run-shared-00000.bin").exists()
    manifest = read_manifest(ram, 1)
    _check(read_section(ram, manifest, manifest.tensors, manifest.state), state)
    assert ram.read(f"{step_dirname(1)}/run-shared-00000.bin")[:8] == bytes(state["w"].view(torch.uint8)[:8])
    ram.finish_restore(1)
    assert sorted(os.listdir(ec_dir)) == ["0", "1", "2", "3", "4", "5", "layout.json"]


@pytest.mark.parametrize("lost", [(0, 1), (2,), (3, 5)])
def test_lost_data_shares_are_rebuilt_from_parity(saved, lost):
    ram, state, ec_dir = saved
    for i in lost:
        os.unlink(ec_dir / str(i))
    _check(_restore(ram), state)
    assert not [f for f in os.listdir(ec_dir) if f.startswith(".") or f == "reading.json"]


def test_a_flipped_byte_in_a_data_share_is_detected_and_rebuilt(saved, caplog):
    ram, state, ec_dir = saved
    raw = bytearray((ec_dir / "1").read_bytes())
    raw[1234] ^= 0x40
    (ec_dir / "1").write_bytes(bytes(raw))
    targets = {
        e.name: torch.zeros(e.global_shape, dtype=torch.float32)
        for e in read_manifest(ram, 1).tensors
        if e.dtype == "float32"
    }
    with caplog.at_level("WARNING"):
        _check(_restore(ram, targets), state)
    assert "failed its checksum; verifying every share" in caplog.text
    assert "share 1 (checksum mismatch" in caplog.text
    assert not [f for f in os.listdir(ec_dir) if f.startswith(".") or f == "reading.json"]


def test_an_intact_restore_hashes_no_share_and_reads_each_byte_once(saved, monkeypatch, caplog):
    """The loader's chunk checks are the verification: no share is hashed up front, nothing is logged."""
    ram, state, ec_dir = saved
    hashed = []
    monkeypatch.setattr(ram_shares, "file_digest", lambda *a: hashed.append(a))
    before = ram.bytes_read
    with caplog.at_level("WARNING"):
        _check(_restore(ram), state)
    assert hashed == [] and caplog.text == ""
    assert ram.bytes_read - before == sum(t.numel() * t.element_size() for t in state.values())


def test_a_flipped_byte_in_a_parity_share_is_found_only_when_parity_is_needed(saved, caplog):
    ram, state, ec_dir = saved
    raw = bytearray((ec_dir / "4").read_bytes())
    raw[77] ^= 1
    (ec_dir / "4").write_bytes(bytes(raw))
    _check(_restore(ram), state)  # the data shares are intact: parity is not read
    os.unlink(ec_dir / "0")  # now a data share is lost: the rebuild from the bad parity fails its chunk checks,
    with caplog.at_level("WARNING"):  # and the verified retry rebuilds from the good share 5 instead
        _check(_restore(ram), state)
    assert "share 4 (checksum mismatch" in caplog.text


def test_a_corruption_beyond_repair_raises_the_shares_it_lacks(saved):
    ram, _state, ec_dir = saved
    for i in (0, 4, 5):
        raw = bytearray((ec_dir / str(i)).read_bytes())
        raw[5] ^= 1
        (ec_dir / str(i)).write_bytes(bytes(raw))
    with pytest.raises(SnapshotError, match=r"3 good share\(s\) of the 4 needed"):
        _restore(ram)
    assert not [f for f in os.listdir(ec_dir) if f.startswith(".") or f == "reading.json"]


def test_shares_laid_out_by_another_version_are_refused_with_a_reason(saved, caplog):
    ram, _state, ec_dir = saved
    layout = json.loads((ec_dir / "layout.json").read_text())
    del layout["layout"]  # the striped layout of 0.1.0.dev before contiguous data shares
    (ec_dir / "layout.json").write_text(json.dumps(layout))
    with caplog.at_level("WARNING"), pytest.raises(SnapshotError, match="cannot rebuild"):
        _restore(ram)
    assert "laid out by another version of lightning-snapshot (layout 'striped'" in caplog.text
