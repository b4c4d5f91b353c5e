"""A state part registered by user code (tests/scripts/state_part.py: a tally held by a test-only object, in no
state_dict and no checkpoint) is captured with every snapshot and resumed bitwise after a SIGKILL and a restart."""

from __future__ import annotations

import pytest
import torch
from conftest import assert_fresh, assert_resumed, run_script

from lightning_snapshot.backends import LocalTier
from lightning_snapshot.persist.writer import committed_steps


@pytest.mark.slow
@pytest.mark.parametrize("phase", ["TRAIN_START", "FIRST_FETCH"])
def test_a_registered_state_part_resumes_bitwise_after_sigkill(tmp_path, phase):
    ref, got = tmp_path / "ref.pt", tmp_path / "resumed.pt"
    run_script("state_part.py", "--dir", str(tmp_path / "ref"), "--out", str(ref), "--phase", phase)
    snaps = tmp_path / "snaps"
    proc = run_script(
        "state_part.py",
        "--dir",
        str(snaps),
        "--out",
        str(tmp_path / "x.pt"),
        "--phase",
        phase,
        "--crash-at",
        "9",
        expect_kill=True,
    )
    assert_fresh(proc)
    committed = committed_steps(LocalTier(snaps))
    assert committed, "the killed run committed no snapshot"
    proc = run_script("state_part.py", "--dir", str(snaps), "--out", str(got), "--phase", phase)
    assert_resumed(proc, committed[0], snaps)
    want, have = torch.load(ref, weights_only=True), torch.load(got, weights_only=True)
    assert have["count"] == want["count"] == 20
    assert torch.equal(have["weight"], want["weight"])  # (the run itself resumed exactly)
    assert torch.equal(have["acc"], want["acc"]), f"the tally differs: {have['acc']} vs {want['acc']}"
