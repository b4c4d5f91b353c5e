"""The replica check end to end, with real DDP processes (2 ranks, gloo, Lightning's subprocess launcher) running
tests/scripts/setups.py: a rank that moves one parameter by one ulp is caught and named (``on_replica_mismatch``
"warn", "skip" and "raise" each do what they say, ``inspect`` shows the outcome), and so is one ulp in the last value
of parameters of a megabyte (the checksum's 64-bit-word path); a fault that persists is caught by the default
rotating check and a resume skips the snapshots whose replicas disagreed; ``BackboneFinetuning`` under DDP is caught
at the first snapshot after the unfrozen backbone trained; and a long DDP run with dropout, shuffling and
augmentation in loader workers, every tensor compared at every step, raises no false alarm."""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

import pytest
from conftest import assert_fresh, assert_resumed, run_script

from lightning_snapshot.backends import LocalTier
from lightning_snapshot.cli.main import main
from lightning_snapshot.persist.writer import committed_steps
from lightning_snapshot.restore.loader import read_manifest

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("test_replicas")]

DDP = ("--trainer", 'strategy="ddp"', "--trainer", "devices=2")
CAUGHT = re.compile(r"the replicas of the model disagree at step (\d+): (\d+) of (\d+) tensors")


def _run(d: Path, setup: str, *args: str, expect_rc: int = 0):
    return run_script(
        "setups.py",
        "--dir",
        str(d),
        "--out",
        str(d / "out.pt"),
        "--setup",
        setup,
        *DDP,
        *args,
        expect_rc=expect_rc,
        timeout=600,
    )


def _caught(proc) -> list[int]:
    """The steps at which a rank warned that the replicas disagree (each step once)."""
    return sorted({int(m.group(1)) for m in CAUGHT.finditer(proc.stderr)})


def _inspect(snaps: Path, step: int) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["inspect", str(snaps), "--step", str(step)]) == 0
    return out.getvalue()


# the parameter a rank corrupts (the last Linear's weight, net.4) after the optimizer step of step 6; snapshots every 2
ONCE = ("--perturb", "6:1:net.4.weight", "--every", "2")
EACH = ("--perturb", "6+:1:net.4.weight", "--every", "2")  # and after every later step: a fault that persists


def test_one_ulp_on_one_rank_is_caught_at_once_and_named(tmp_path):
    """Every tensor compared at every snapshot (``replica_check=1``): rank 1 moves one value of ``net.4.weight`` by
    one ulp after step 6; the snapshot of step 6 names that parameter and rank 1 and nothing else, is recorded as
    unhealthy, and ``inspect`` shows it; the snapshots before agree. (Later updates may round the difference away:
    then the replicas agree again, and later snapshots say so.)"""
    d = tmp_path / "once"
    proc = _run(d, "aug-main", *ONCE, "--max-steps", "6", "--snapshot", "replica_check=1")
    assert _caught(proc) == [6], proc.stderr[-3000:]
    assert "1 of " in proc.stderr and "'net.4.weight' (rank 1)" in proc.stderr
    assert "committed as unhealthy" in proc.stderr
    tier = LocalTier(d / "snaps")
    assert committed_steps(tier) == [6, 4]
    m = read_manifest(tier, 6)
    assert m.replicas.disagree == (("net.4.weight", (1,)),) and not m.healthy, m.replicas
    assert m.replicas.disagree_count == 1 and m.replicas.checked > 10
    before = read_manifest(tier, 4)
    assert before.replicas.disagree_count == 0 and before.replicas.checked == m.replicas.checked and before.healthy
    shown = _inspect(d / "snaps", 6)
    assert "health: replicas disagree" in shown
    assert "replicas: DISAGREE: 1 of " in shown and "'net.4.weight' differs on rank 1" in shown
    assert "replicas: agree (" in _inspect(d / "snaps", 4)


def test_a_persistent_fault_is_caught_within_four_snapshots_and_a_resume_skips_what_it_tainted(tmp_path):
    """The default check (each snapshot a quarter of the state, rotating) against a fault that persists (rank 1
    moves the value again after every step from step 6): caught within 4 snapshots, naming the parameter and rank 1;
    every snapshot from then on records it (the tensor stays compared until it agrees) and is unhealthy; the ones
    before agree. A rerun resumes from the newest healthy snapshot (retention kept it) with a warning that says why,
    and its replicas agree again (the restore gave every rank the same state)."""
    d = tmp_path / "each"
    proc = _run(d, "aug-main", *EACH, "--max-steps", "16")
    caught = _caught(proc)
    assert caught and 6 <= caught[0] <= 12, (caught, proc.stderr[-3000:])
    first = caught[0]
    assert caught == list(range(first, 17, 2)), caught  # (sticky: every later snapshot)
    assert "'net.4.weight' (rank 1)" in proc.stderr
    tier = LocalTier(d / "snaps")
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

    again = _run(d, "aug-main", "--every", "2", "--max-steps", "20")
    assert_resumed(again, healthy, d / "snaps", ranks=2)
    why = "skipping the unhealthy snapshot of step 16: the ranks' replicas of 'net.4.weight' disagreed"
    assert why in again.stderr, again.stderr[-3000:]
    assert not _caught(again), again.stderr[-3000:]
    assert read_manifest(tier, 20).replicas.disagree_count == 0


def test_one_ulp_in_the_last_value_of_megabyte_parameters_is_caught_and_named(tmp_path):
    """At a real model's tensor sizes (the checksum's 64-bit-word path): setup ``big`` has two hidden weights of a
    megabyte, ``net.2.weight`` (511 x 512 float32, 1,046,528 bytes: its last value is in its last whole 64-bit word)
    and ``net.4.weight`` (513 x 511, 1,048,572 bytes: its last value is the 4 bytes past it). Rank 1 moves the last
    value of each by one ulp after step 6: the snapshot of step 6 names both, with rank 1, and nothing else; the
    snapshot of step 4 agrees. (A checksum that ignored the last word, or the bytes past it, would miss one.)"""
    d = tmp_path / "big"
    proc = _run(
        d,
        "big",
        "--perturb",
        "6:1:net.2.weight,net.4.weight:last",
        "--every",
        "2",
        "--max-steps",
        "6",
        "--snapshot",
        "replica_check=1",
    )
    assert _caught(proc) == [6], proc.stderr[-3000:]
    assert "2 of " in proc.stderr, proc.stderr[-3000:]
    assert "'net.2.weight' (rank 1)" in proc.stderr and "'net.4.weight' (rank 1)" in proc.stderr, proc.stderr[-3000:]
    tier = LocalTier(d / "snaps")
    m = read_manifest(tier, 6)
    assert sorted(m.replicas.disagree) == [("net.2.weight", (1,)), ("net.4.weight", (1,))], m.replicas
    assert m.replicas.disagree_count == 2 and not m.healthy
    before = read_manifest(tier, 4)
    assert before.replicas.disagree_count == 0 and before.replicas.checked == m.replicas.checked, before.replicas


@pytest.mark.parametrize("action", ["skip", "raise"])
def test_on_replica_mismatch_skip_drops_the_snapshot_and_raise_stops_training(tmp_path, action):
    """``replica_check=1``, one ulp on rank 1 after step 6 (caught at step 6). ``skip``: the snapshot of step 6 (and
    any later one whose replicas still disagree) is not written, and training goes on. ``raise``: training
    stops at step 6 on every rank with ``ReplicaMismatchError`` naming the parameter and the rank; nothing from step 6
    is committed."""
    d = tmp_path / action
    args = ("--snapshot", "replica_check=1", "--snapshot", f'on_replica_mismatch="{action}"')
    if action == "skip":
        proc = _run(d, "aug-main", *ONCE, "--max-steps", "8", *args)
        caught = _caught(proc)
        assert caught[:1] == [6], proc.stderr[-3000:]
        for step in caught:  # (step 8 too when no update rounded the difference away)
            assert f"skipped the snapshot of step {step}: its replicas disagree" in proc.stderr
        written = sorted({2, 4, 6, 8} - set(caught), reverse=True)[:2]  # (retention keeps the newest 2)
        assert committed_steps(LocalTier(d / "snaps")) == written
        return
    proc = _run(d, "aug-main", *ONCE, "--max-steps", "16", *args, expect_rc=1)
    assert "ReplicaMismatchError" in proc.stderr and "on_replica_mismatch='raise'" in proc.stderr
    assert _caught(proc) == [6] and "'net.4.weight' (rank 1)" in proc.stderr
    assert committed_steps(LocalTier(d / "snaps")) == [4, 2]


def test_backbone_finetuning_under_ddp_is_caught_at_the_first_snapshot_after_the_backbone_trained(tmp_path):
    """BackboneFinetuning unfreezes the backbone at epoch 1 (steps 9-16 under DDP(2)); DDP wrapped the model while
    it was frozen, so it does not average the backbone's gradients and each rank trains its own copy. The snapshot of
    step 8 (the unfreeze happened before it was finished, nothing trained yet) agrees; the one of step 10, the first
    after the backbone trained, is caught, naming backbone parameters. ``replica_check=8``: the rotation alone would
    not compare the backbone at step 10 (the parameters newly trained are compared at the next checks)."""
    d = tmp_path / "finetune"
    proc = _run(d, "finetune", "--every", "2", "--max-steps", "16", "--snapshot", "replica_check=8")
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
