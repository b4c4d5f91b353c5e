"""The replica check end to end, with real DDP processes (2 ranks, gloo, Lightning's subprocess launcher) running
tests/scripts/setups.py: a rank that moves one parameter by one ulp is caught and named (``on_replica_mismatch``
"warn", "skip" and "raise" each do what they say, ``inspect`` shows the outcome, and a resume skips the snapshots
whose replicas disagreed); ``BackboneFinetuning`` under DDP is caught at the first snapshot after the unfrozen
backbone trained; and a long DDP run with dropout, shuffling and augmentation in loader workers, every tensor compared
at every step, raises no false alarm."""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

import pytest
from conftest import assert_fresh, assert_resumed, run_script

from lightning_snapshot.backends import LocalTier
from lightning_snapshot.cli import main
from lightning_snapshot.loader import read_manifest
from lightning_snapshot.writer import committed_steps

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("test_replicas")]

DDP = ("--trainer", 'strategy="ddp"', "--trainer", "devices=2")
CAUGHT = re.compile(r"the replicas of the model disagree at step (\d+): (\d+) of (\d+) tensors")


def _run(d: Path, setup: str, *args: str, expect_rc: int = 0):
    return run_script("setups.py", "--dir", str(d), "--out", str(d / "out.pt"), "--setup", setup, *DDP, *args,
                      expect_rc=expect_rc, timeout=600)


def _caught(proc) -> list[int]:
    """The steps at which a rank warned that the replicas disagree (each step once)."""
    return sorted({int(m.group(1)) for m in CAUGHT.finditer(proc.stderr)})


def _inspect(snaps: Path, step: int) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["inspect", str(snaps), "--step", str(step)]) == 0
    return out.getvalue()


# the parameter a rank corrupts: the last Linear's weight (net.4), after the optimizer step of step 6
PERTURB = ("--perturb", "6:1:net.4.weight", "--every", "2", "--max-steps", "16")


def test_a_rank_that_moves_one_parameter_by_one_ulp_is_caught_named_and_skipped_by_a_resume(tmp_path):
    """Snapshots every 2 steps, every tensor compared over 4 snapshots (the default): the change on rank 1 at step 6
    is caught within 4 snapshots, naming the parameter and the rank; every snapshot from then on records it (the
    tensor stays compared until it agrees) and is unhealthy; the snapshots before agree. A rerun resumes from the
    newest healthy snapshot with a warning that says why, and its replicas agree again (the restore gave every rank
    the same state)."""
    d = tmp_path / "run"
    proc = _run(d, "aug-main", *PERTURB)
    caught = _caught(proc)
    assert caught, proc.stderr[-3000:]
    first = caught[0]
    assert 6 <= first <= 12, caught
    assert caught == list(range(first, 17, 2)), caught  # (sticky: every later snapshot)
    assert "'net.4.weight' (rank 1)" in proc.stderr and "1 of " in proc.stderr
    assert "committed as unhealthy" in proc.stderr
    snaps = d / "snaps"
    tier = LocalTier(snaps)
    steps = committed_steps(tier)
    assert steps[:2] == [16, 14], steps
    for step in steps:
        m = read_manifest(tier, step)
        assert m.replicas is not None and m.replicas.checked > 0, step
        if step >= first:
            assert m.replicas.disagree == (("net.4.weight", (1,)),) and not m.healthy, (step, m.replicas)
        else:
            assert m.replicas.disagree_count == 0 and m.healthy, (step, m.replicas)
    healthy = max(s for s in steps if s < first)  # (retention keeps the newest healthy snapshot)
    shown = _inspect(snaps, 16)
    assert "health: replicas disagree" in shown
    assert "replicas: DISAGREE: 1 of " in shown and "'net.4.weight' differs on rank 1" in shown
    assert "replicas: agree (" in _inspect(snaps, healthy)

    again = _run(d, "aug-main", "--every", "2", "--max-steps", "20")
    assert_resumed(again, healthy, snaps, ranks=2)
    why = "skipping the unhealthy snapshot of step 16: the ranks' replicas of 'net.4.weight' disagreed"
    assert why in again.stderr, again.stderr[-3000:]
    assert not _caught(again), again.stderr[-3000:]
    assert read_manifest(tier, 20).replicas.disagree_count == 0


@pytest.mark.parametrize("action", ["skip", "raise"])
def test_on_replica_mismatch_skip_drops_the_snapshot_and_raise_stops_training(tmp_path, action):
    """Every tensor compared at every snapshot (``replica_check=1``): the change of step 6 is caught at step 6.
    ``skip``: no snapshot from step 6 on is committed, the earlier ones are. ``raise``: training stops at step 6 on
    every rank with ``ReplicaMismatchError`` naming the parameter and the rank; nothing from step 6 is committed."""
    d = tmp_path / action
    args = (*PERTURB, "--snapshot", "replica_check=1", "--snapshot", f'on_replica_mismatch="{action}"')
    if action == "skip":
        proc = _run(d, "aug-main", *args)
        assert _caught(proc) == list(range(6, 17, 2)), proc.stderr[-3000:]
        assert "skipped the snapshot of step 6: its replicas disagree" in proc.stderr
        assert committed_steps(LocalTier(d / "snaps")) == [4, 2]
        return
    proc = _run(d, "aug-main", *args, expect_rc=1)
    assert "ReplicaMismatchError" in proc.stderr and "on_replica_mismatch='raise'" in proc.stderr
    assert _caught(proc) == [6] and "'net.4.weight' (rank 1)" in proc.stderr
    assert committed_steps(LocalTier(d / "snaps")) == [4, 2]


def test_backbone_finetuning_under_ddp_is_caught_at_the_first_snapshot_after_the_backbone_trained(tmp_path):
    """BackboneFinetuning unfreezes the backbone at epoch 1 (steps 9-16 under DDP(2)); DDP wrapped the model while
    it was frozen, so it does not average the backbone's gradients and each rank trains its own copy. The snapshot of
    step 8 (the unfreeze happened before it was finished, nothing trained yet) agrees; the one of step 10, the first
    after the backbone trained, is caught, naming backbone parameters. Default replica_check (4 snapshots)."""
    d = tmp_path / "finetune"
    proc = _run(d, "finetune", "--every", "2", "--max-steps", "16")
    caught = _caught(proc)
    assert caught and caught[0] == 10, (caught, proc.stderr[-3000:])
    assert re.search(r"'backbone\.\d\.(weight|bias)' \(rank 1\)", proc.stderr), proc.stderr[-3000:]
    tier = LocalTier(d / "snaps")
    assert read_manifest(tier, 16).replicas_disagree
    earlier = [s for s in committed_steps(tier) if s < 10]
    assert earlier and all(not read_manifest(tier, s).replicas_disagree for s in earlier)


def test_no_false_alarm_over_a_long_ddp_run_with_dropout_shuffling_and_loader_workers(tmp_path):
    """48 steps (6 epochs) of DDP(2) with dropout, a shuffled loader and augmentation in 2 persistent loader workers
    per rank, a snapshot at every step comparing every parameter and optimizer state tensor: no rank ever warns and
    every committed manifest records that all of them agree."""
    d = tmp_path / "long"
    proc = _run(d, "aug-workers-persistent", "--every", "1", "--max-steps", "48", "--snapshot", "replica_check=1")
    assert_fresh(proc)
    assert not _caught(proc), proc.stderr[-3000:]
    tier = LocalTier(d / "snaps")
    for step in committed_steps(tier):
        m = read_manifest(tier, step)
        assert m.replicas is not None and m.replicas.disagree_count == 0 and m.replicas.checked >= 10, (step, m)
    assert committed_steps(tier)[0] == 48
