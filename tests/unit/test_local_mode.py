"""Local-tier permissions: the files and directories of a written snapshot follow the umask (as ``torch.save``
does), or ``mode=`` exactly; bad ``mode`` values are refused naming the option and the accepted form."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
import torch

from lightning_snapshot.backends import LocalTier, parse_tier
from lightning_snapshot.backends.base import Backend
from lightning_snapshot.backends.mapped_files import map_new
from lightning_snapshot.dist.comm import LocalComm
from lightning_snapshot.errors import ConfigError
from lightning_snapshot.format.manifest import step_dirname
from lightning_snapshot.persist.writer import SnapshotJob, write_snapshot
from lightning_snapshot.restore.loader import load_snapshot
from lightning_snapshot.staging import stage

STATE = {"w": torch.arange(12, dtype=torch.float32).reshape(3, 4), "b": torch.ones(3)}


def _perm(p: Path) -> int:
    return stat.S_IMODE(os.stat(p).st_mode)


def _write_under_umask(tier: LocalTier, umask: int) -> Path:
    """Commit a real snapshot of step 5 into ``tier`` with the process umask ``umask``; returns its directory."""
    job = SnapshotJob(5, 0, shared=stage(STATE), private=stage({"rng": torch.zeros(4, dtype=torch.uint8)}, "rank"))
    old = os.umask(umask)
    try:
        write_snapshot(tier, LocalComm(), job, run_id="perm")
    finally:
        os.umask(old)
    step_dir = tier.root / step_dirname(5)
    files = [p for p in step_dir.iterdir()]
    assert any(p.name == "manifest.json" for p in files) and any(p.suffix == ".bin" for p in files), files
    return step_dir


def _torch_save_mode(tmp_path: Path, umask: int) -> int:
    old = os.umask(umask)
    try:
        torch.save(STATE, tmp_path / f"ref-{umask:o}.pt")
    finally:
        os.umask(old)
    return _perm(tmp_path / f"ref-{umask:o}.pt")


@pytest.mark.parametrize("umask", [0o022, 0o077, 0o002], ids=["umask022", "umask077", "umask002"])
def test_snapshot_files_and_directories_follow_the_umask_like_torch_save(tmp_path, umask):
    root = tmp_path / "tier" / "run"  # (two directories the tier creates)
    step_dir = _write_under_umask(LocalTier(root), umask)
    for d in (tmp_path / "tier", root, step_dir):
        assert _perm(d) == 0o777 & ~umask, d
    for f in step_dir.iterdir():
        assert _perm(f) == 0o666 & ~umask == _torch_save_mode(tmp_path, umask), f
    assert torch.equal(load_snapshot(str(root), rank=0)["w"], STATE["w"])


@pytest.mark.parametrize("how", ["LocalTier(mode=0o600)", "file:///PATH?mode=0600", "PATH?mode=0o600"])
def test_mode_0600_makes_a_snapshot_private_whatever_the_umask(tmp_path, how):
    root = tmp_path / "outer" / "run"
    (tmp_path / "outer").mkdir(mode=0o755)
    os.chmod(tmp_path / "outer", 0o755)
    tier = LocalTier(root, mode=0o600) if how.startswith("LocalTier") else parse_tier(how.replace("PATH", str(root)))
    assert tier.mode == 0o600
    step_dir = _write_under_umask(tier, 0o002)  # (a permissive umask: mode= wins)
    assert _perm(root) == _perm(step_dir) == 0o700
    assert _perm(tmp_path / "outer") == 0o755, "a directory the tier did not create is left as it was"
    assert sorted(_perm(f) for f in step_dir.iterdir()) == [0o600] * len(list(step_dir.iterdir()))
    # the snapshot agent rebuilds the tier from its spec and writes with the same mode
    assert Backend.from_spec(tier.spec()).mode == 0o600
    assert torch.equal(load_snapshot(str(root), rank=0)["b"], STATE["b"])


def test_mode_0640_gives_directories_the_matching_search_bits_and_covers_fetched_objects(tmp_path):
    tier = LocalTier(tmp_path / "t", mode="0640")
    step_dir = _write_under_umask(tier, 0o077)  # (a strict umask: mode= wins too)
    assert _perm(step_dir) == 0o750
    assert {_perm(f) for f in step_dir.iterdir()} == {0o640}
    # an object a node-local restore fetches from another node lands under the same rule
    mm = map_new(tmp_path / "fetched", 4096, tier.mode, tier.file_mode)
    mm.close()
    assert _perm(tmp_path / "fetched") == 0o640


@pytest.mark.parametrize("value", ["0400", "0999", "1777", "600x", "", "rw-------", "0o7777"])
def test_bad_mode_in_a_url_names_the_option_and_the_accepted_form(tmp_path, value):
    with pytest.raises(ConfigError) as e:
        parse_tier(f"{tmp_path}?mode={value}")
    assert str(e.value) == (
        "tier URL option mode must be file permissions in octal that give the owner read and write, from 0o600 to"
        " 0o777, e.g. mode=0o600 (URL: ?mode=0600) for files only the owner can read; got " + repr(value)
    )
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("value", [0o400, 0o1600, -1, True, 600.0, "seven"])
def test_bad_mode_argument_is_refused(tmp_path, value):
    with pytest.raises(
        ConfigError,
        match=r"^LocalTier mode must be file permissions in octal that give the owner"
        r" read and write, from 0o600 to 0o777, e\.g\. mode=0o600 .* got ",
    ):
        LocalTier(tmp_path, mode=value)


def test_mode_given_twice_in_a_url_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="tier URL option 'mode' is given twice"):
        parse_tier(f"{tmp_path}?mode=0600&mode=0640")
