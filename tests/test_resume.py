"""Bitwise-exact resume in real subprocesses: an uninterrupted run vs. the same run SIGKILLed and restarted."""

from __future__ import annotations

import pytest
from conftest import assert_bitwise_equal, assert_fresh, assert_resumed, run_train

from lightning_snapshot.backends import LocalTier
from lightning_snapshot.persist.writer import committed_steps
from lightning_snapshot.restore.loader import read_manifest

# (id, train.py arguments, range of the crash step)
CASES = [
    ("shuffle-dropout-mid-epoch", ("--shuffle", "--dropout", "0.2"), (5, 15)),
    ("no-shuffle", (), (5, 19)),
    ("epoch-boundary", ("--shuffle", "--dropout", "0.2", "--every", "4"), (17, 19)),
    (
        "grad-accumulation",
        ("--shuffle", "--dropout", "0.2", "--accumulate", "2", "--every", "2", "--max-steps", "12"),
        (5, 11),
    ),
    ("stateful-dataloader", ("--loader", "stateful", "--shuffle", "--dropout", "0.2"), (5, 19)),
    ("loader-workers", ("--shuffle", "--workers", "2"), (5, 19)),
]


@pytest.mark.slow
@pytest.mark.parametrize("args,crash_range", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_sigkill_and_resume_is_bitwise_exact(tmp_path, reference_runs, crash_rng, args, crash_range):
    ref = reference_runs(*args)
    crash_at = crash_rng.randint(*crash_range)
    snaps = tmp_path / "snaps"
    assert_fresh(run_train(snaps, tmp_path / "crashed.pt", *args, "--crash-at", str(crash_at), expect_kill=True))
    committed = committed_steps(LocalTier(snaps))
    assert committed, "the killed run committed no snapshot"
    proc = run_train(snaps, tmp_path / "resumed.pt", *args)
    try:
        assert_resumed(proc, committed[0], snaps)
        assert_bitwise_equal(ref, tmp_path / "resumed.pt", since=committed[0])
    except AssertionError as e:
        raise AssertionError(f"crash at global_step {crash_at} ({args}): {e}") from None


@pytest.mark.slow
def test_ddp_two_ranks_sigkill_and_resume_is_bitwise_exact(tmp_path, reference_runs, crash_rng):
    args = ("--devices", "2", "--shuffle", "--dropout", "0.2", "--max-steps", "12", "--every", "2")
    ref = reference_runs(*args)
    crash_at = crash_rng.randint(5, 11)
    snaps = tmp_path / "snaps"
    run_train(snaps, tmp_path / "crashed.pt", *args, "--crash-at", str(crash_at), expect_kill=True)
    committed = committed_steps(LocalTier(snaps))
    proc = run_train(snaps, tmp_path / "resumed.pt", *args)
    assert_resumed(proc, committed[0], snaps, ranks=2)
    assert_bitwise_equal(ref, tmp_path / "resumed.pt")
    assert_bitwise_equal(ref.with_name("out.pt.rank1"), tmp_path / "resumed.pt.rank1")
    # the replicated state was written once, by both ranks, each a disjoint share
    tier = LocalTier(snaps)
    manifest = read_manifest(tier, committed_steps(tier)[0])
    writers = {o.rank for o in manifest.objects if "-shared-" in o.key}
    assert writers == {0, 1}, manifest.objects


@pytest.mark.slow
def test_ddp_two_ranks_augmenting_in_persistent_loader_workers_resume_bitwise(tmp_path, reference_runs):
    """What a new user writes under DDP: ``DataLoader(ds, shuffle=True, num_workers=2, persistent_workers=True)``
    whose dataset draws from torch, numpy and python ``random``; each rank has its own workers. Killed at step 9 and
    resumed from step 8, the first batch of epoch 1 (8 batches a rank and epoch): every worker carries its RNG from
    epoch 0."""
    args = (
        "--devices",
        "2",
        "--shuffle",
        "--workers",
        "2",
        "--persistent",
        "--augment",
        "--max-steps",
        "12",
        "--every",
        "2",
    )
    ref = reference_runs(*args)
    snaps = tmp_path / "snaps"
    run_train(snaps, tmp_path / "crashed.pt", *args, "--crash-at", "9", "--crash-after-newest", expect_kill=True)
    proc = run_train(snaps, tmp_path / "resumed.pt", *args)
    assert_resumed(proc, 8, snaps, ranks=2)
    assert_bitwise_equal(ref, tmp_path / "resumed.pt")
    assert_bitwise_equal(ref.with_name("out.pt.rank1"), tmp_path / "resumed.pt.rank1")


@pytest.mark.slow
def test_crash_between_data_and_manifest_leaves_step_invisible(tmp_path, reference_runs):
    args = ("--shuffle", "--dropout", "0.2")
    snaps = tmp_path / "snaps"
    run_train(snaps, tmp_path / "crashed.pt", *args, "--kill-before-commit", "9", expect_kill=True)
    step_dir = snaps / "step-000000000009"
    assert step_dir.is_dir() and any(p.suffix == ".bin" for p in step_dir.iterdir()), "data was written"
    assert not (step_dir / "manifest.json").exists()
    assert committed_steps(LocalTier(snaps)) == [6, 3]
    proc = run_train(snaps, tmp_path / "resumed.pt", *args)
    assert_resumed(proc, 6, snaps)
    assert_bitwise_equal(reference_runs(*args), tmp_path / "resumed.pt")
    # the re-run committed its own snapshots, the last step's at the end of fit, and retention (keep_last=2)
    # removed the rest, crashed write included
    assert committed_steps(LocalTier(snaps)) == [20, 18]
    assert sorted(p.name for p in snaps.iterdir()) == ["step-000000000018", "step-000000000020"]
