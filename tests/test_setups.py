"""Exact resume in the Lightning setups users run: each setup of tests/scripts/setups.py is SIGKILLed at a step
that is not a snapshot step (for the validation setups: right after a snapshot step that is also a validation step),
restarted, and compared with an uninterrupted run by the one comparison helper (``fingerprint.assert_same_run``:
weights, optimizer states and param groups, scheduler states, loop progress, every callback's state (EarlyStopping,
ModelCheckpoint), the torch/CUDA/numpy/python RNG, every value logged), plus the checkpoint files ModelCheckpoint
left (by name and content), the validation steps, the learning rates and the last batch trained. Every run reports
its restore when it happens, and each must have resumed from the newest committed snapshot (the first: started
fresh). The uninterrupted run must also equal the same fit without the library (neutrality), run first in the same
process."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import assert_bitwise_equal, assert_fresh, assert_resumed, run_script
from fingerprint import assert_same_run

from lightning_snapshot.backends import LocalTier
from lightning_snapshot.persist.writer import committed_steps


def run_setup(tmp: Path, name: str, *args: str, expect_kill: bool = False):
    return run_script(
        "setups.py", "--dir", str(tmp), "--out", str(tmp / "out.pt"), "--setup", name, *args, expect_kill=expect_kill
    )


# (setup, extra arguments, crash steps). Snapshots every 4 steps; an epoch is 16 steps; validation setups validate
# at every epoch end (val-epoch, plateau-epoch) or every 4 batches (val-interval, plateau-step).
CASES = [
    ("val-epoch", (), (17, 34)),  # right after the epoch-end snapshot + validation; mid-epoch later
    ("val-interval", (), (5, 14)),  # right after a snapshot step that is also a validation step
    ("plateau-epoch", ("--every", "3"), (20,)),  # mid-epoch: the epoch-end plateau step must still happen
    ("plateau-step", (), (5, 13)),
    ("aug-main", ("--every", "3"), (8, 17)),
    # 2 loader workers; resumed at batch 9 of epoch 0 and 5 of epoch 1 (odd: the round robin is rotated)
    ("aug-workers", ("--every", "3"), (10, 23)),
    # persistent workers carry their RNG across epochs: resumed at the last batch of epoch 0 and at batch 1 of epoch 2
    ("aug-workers-persistent", ("--every", "3"), (17, 35)),
    # seed_everything without workers=True (torch seeds the workers); resumed at the first batch of epoch 1
    ("aug-workers-plain", ("--every", "4"), (18,)),
    ("stateful-iterable", ("--every", "3"), (8, 20)),
    ("manual-two-optimizers", (), (10, 30)),
    ("bf16-mixed", ("--every", "3"), (8,)),
    # Lightning's callbacks that change the training during fit (snapshots every 4 steps, epochs of 16 steps):
    ("finetune", (), (18, 22)),  # snapshot at 16 (epoch 1 has begun: backbone unfrozen), then mid-epoch
    ("swa", (), (22, 48)),  # inside its first averaging epoch; at its BatchNorm-update epoch (one step)
    ("lr-monitor", (), (10,)),  # OneCycleLR per step, every learning rate logged
    ("grad-accum", (), (22, 30)),  # within epoch 1 (2 batches per step) and epoch 3 (4 per step)
    ("early-stop-train", (), (22,)),  # within epoch 1: its epoch mean must include steps 17-20
    ("ckpt-steps", (), (10,)),  # ModelCheckpoint wrote step 9 after the snapshot of step 8
    # EMAWeightAveraging: the averaged weights travel in on_save_checkpoint, are swapped in for each validation
    # (every 4 steps: right after the snapshot of step 8) and copied into the model at on_train_end
    ("ema", (), (9, 21)),
    ("user-hooks", (), (10,)),  # a user callback's state in on_save_checkpoint/on_load_checkpoint
    # an epoch-interval scheduler, validation twice an epoch (val_check_interval=0.5), ModelCheckpoint(save_last)
    # whose current_score is only set by a top-k save: resumed after the validation of step 24
    ("epoch-sched", (), (26,)),
    ("metric-obj", (), (10, 23)),  # a torchmetrics Metric logged per epoch, monitored by EarlyStopping
    # ModelPruning prunes (renaming weight to weight_orig + weight_mask) and resets the weights (lottery ticket) at
    # each epoch end, after the last batch's on_train_batch_end: resumed from the snapshots of steps 16 and 32
    ("pruning", (), (17, 35)),
    # BatchSizeFinder scales the datamodule's batch size with trial steps in its on_fit_start (then puts the state
    # back), and the loaders are made again with the batch size found
    ("bs-finder", (), (10, 23)),
    # train_dataloader() reads the epoch, reloaded every 2 epochs (epochs of 8, 8, 16, 16 batches): resumed from the
    # end of epoch 1 (the reload at epoch 2 draws from the restored RNG), then within epoch 3 (its loader was made
    # at epoch 2)
    ("curriculum", (), (17, 37)),
    # CombinedLoader(max_size_cycle): the short loader (6 batches) is in its second pass at the snapshots of steps 8
    # and 24
    ("combined", (), (10, 27)),
    # a batch sampler of the user's own (buckets of 4 batches sorted by length, each bucket's batches shuffled from
    # the global RNG when it is reached), augmentation in 2 workers or in the main process. With workers: resumed
    # inside a bucket (snapshots of steps 6 and 21), after the next bucket's draw was taken ahead; in the main
    # process: at the start of a bucket (steps 8 and 20), whose draw the interrupted run took after its snapshot
    ("bucket", ("--every", "3"), (8, 23)),
    ("bucket-main", (), (10, 23)),
    # random masking from a torch.Generator the model holds (in no state_dict, not the global RNG)
    ("own-generator", (), (10, 23)),
]


@pytest.mark.slow
@pytest.mark.parametrize("name,args,crashes", [pytest.param(*c, id=c[0]) for c in CASES])
def test_sigkill_and_resume_matches_an_uninterrupted_run(tmp_path, name, args, crashes):
    assert_resume_matches(tmp_path, name, args, crashes)


def crash_in_turn(d: Path, args, crashes, ranks: int = 1) -> int:
    """Run ``setups.py args`` in ``d``, SIGKILLed at each of ``crashes`` in turn: the first run must start fresh, and
    every later one report (when it restores, before the kill) a resume from the newest snapshot the killed run
    before it committed, on every rank. Returns the newest step committed at the end."""
    snaps = d / "snaps"
    newest = None
    for crash in crashes:
        proc = run_setup(d, *args, "--crash-at", str(crash), expect_kill=True)
        if newest is None:
            assert_fresh(proc)
        else:
            assert_resumed(proc, newest, snaps, ranks=ranks)
        committed = committed_steps(LocalTier(snaps))
        assert committed, f"{args[0]}: the run killed at step {crash} committed nothing"
        newest = committed[0]
    assert newest is not None
    return newest


def assert_resume_matches(tmp_path: Path, name: str, args, crashes) -> dict:
    """One job killed at each crash step in turn (each run resumes from the snapshot the killed one left, and is
    killed at the next crash step), then run to the end: a resume of a resumed run is covered too, and a divergence
    at any of the crash steps shows in the final state. Every run after the first must report, when it restores
    (before it trains), a resume from the newest snapshot committed in the tier, and the first a fresh start.

    The uninterrupted reference run, with the callback, ends bitwise equal to the same fit without the library
    (run first, in the same process: ``--neutrality``). Returns the uninterrupted run's result."""
    run_setup(tmp_path / "ref", name, *args, "--neutrality")
    ref = tmp_path / "ref" / "out.pt"
    try:
        assert_bitwise_equal(Path(f"{ref}.nolib"), ref)
    except AssertionError as e:
        raise AssertionError(f"{name}: the run with SnapshotCallback differs from the run without it: {e}") from None
    d = tmp_path / "crashed"
    snaps = d / "snaps"
    newest = crash_in_turn(d, (name, *args), crashes)
    proc = run_setup(d, name, *args)
    try:
        assert_resumed(proc, newest, snaps)
        assert_bitwise_equal(ref, d / "out.pt", since=newest)
    except AssertionError as e:
        raise AssertionError(f"{name}, SIGKILL at steps {crashes}: {e}") from None
    return torch.load(ref, weights_only=True)


@pytest.mark.slow
def test_learning_rate_finder_leaves_no_snapshot_of_its_trial_and_the_rerun_resumes(tmp_path):
    """LearningRateFinder trains 20 trial steps in its on_fit_start, with its own callback list, and then puts the
    state back (leaving trainer.ckpt_path set to its temporary checkpoint). None of its trial steps may be
    snapshotted (a resume would restore trial weights), fit's last snapshot is still taken, and a rerun after a
    SIGKILL mid-epoch resumes (the temporary checkpoint is not a ckpt_path given to fit) and ends as an
    uninterrupted run, in the next epoch too (the trial set the loaders and the epoch's iterators up before the
    restore: they are made again from the restored position). Loader workers: 2."""
    args = ("lr-finder", "--max-steps", "20", "--workers", "2")
    run_setup(tmp_path / "ref", *args)
    assert committed_steps(LocalTier(tmp_path / "ref" / "snaps")) == [20, 16]
    d = tmp_path / "crashed"
    run_setup(d, *args, "--crash-at", "10", expect_kill=True)
    assert committed_steps(LocalTier(d / "snaps")) == [8, 4], "a trial step of LearningRateFinder was snapshotted"
    proc = run_setup(d, *args)
    assert_resumed(proc, 8, d / "snaps")
    assert_bitwise_equal(tmp_path / "ref" / "out.pt", d / "out.pt", since=8)


@pytest.mark.slow
def test_ddp_stateful_loader_shuffled_resumes_exactly(tmp_path):
    """torchdata's StatefulDataLoader(shuffle=True) under DDP with 2 ranks: Lightning wraps its sampler in a
    DistributedSamplerWrapper that draws the epoch's order from the global RNG at the epoch's first fetch, and
    restores the loader by fast-forwarding that sampler; the resumed run must draw the same order (and leave the
    global RNG as the interrupted run had it: the augmentation in the main process draws from it). Killed mid-epoch
    (epochs of 8 steps) and again in the next epoch."""
    args = ("stateful-shuffle", "--trainer", 'strategy="ddp"', "--trainer", "devices=2")
    run_setup(tmp_path / "ref", *args)
    d = tmp_path / "crashed"
    assert crash_in_turn(d, args, (6, 11), ranks=2) == 8
    proc = run_setup(d, *args)
    assert_resumed(proc, 8, d / "snaps", ranks=2)
    assert_bitwise_equal(tmp_path / "ref" / "out.pt", d / "out.pt", since=8)


def test_resuming_a_stateful_loader_with_workers_mid_epoch_warns_about_their_rng(tmp_path):
    """A StatefulDataLoader restores its own position, but torchdata restarts its workers' global RNG from their
    seeds: augmentation drawn there cannot be resumed exactly, and the resume says so (no silent divergence)."""
    import lightning as L
    from lightning.pytorch.demos.boring_classes import BoringModel, RandomDataset
    from torchdata.stateful_dataloader import StatefulDataLoader

    from lightning_snapshot import SnapshotCallback
    from lightning_snapshot.backends import LocalTier

    def fit(steps: int) -> list[str]:
        loader = StatefulDataLoader(RandomDataset(32, 64), batch_size=4, num_workers=1)
        trainer = L.Trainer(
            max_steps=steps,
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            callbacks=[SnapshotCallback(LocalTier(tmp_path / "snaps", every_n_train_steps=2))],
        )
        with pytest.warns() as record:
            trainer.fit(BoringModel(), loader)
        return [str(w.message) for w in record]

    fit(5)  # ends mid-epoch (16 batches an epoch): its last snapshot continues that epoch
    warned = [m for m in fit(7) if "worker processes restart their global RNG" in m]
    assert warned and "StatefulDataLoader" in warned[0] and "1 worker processes" in warned[0], warned


@pytest.mark.slow
@pytest.mark.parametrize("name,first", [("aug-workers-persistent", 16), ("ema", 14)])
def test_a_finished_fit_continued_ends_as_one_longer_fit(tmp_path, name, first):
    """A fit that ends, continued with a larger max_steps, ends as one longer fit. aug-workers-persistent ends with
    its epoch (max_steps=16, 16 batches an epoch): its persistent loader workers carry their RNG into epoch 1 (the
    snapshot at the end of fit holds it). ema: EMAWeightAveraging copies the averaged weights into the model in its
    on_train_end, which a longer run would not have done at step 14: the snapshot at the end of fit is taken
    before."""
    run_setup(tmp_path / "ref", name, "--max-steps", "24")
    d = tmp_path / "continued"
    run_setup(d, name, "--max-steps", str(first))
    proc = run_setup(d, name, "--max-steps", "24")
    assert_resumed(proc, first, d / "snaps")
    assert_bitwise_equal(tmp_path / "ref" / "out.pt", d / "out.pt", since=first)


@pytest.mark.slow
def test_sigterm_snapshots_the_current_step_and_the_rerun_continues_exactly(tmp_path):
    """A preempted job (SIGTERM, owned by the callback during the fit) snapshots the step it stopped at, although no
    snapshot was due (every 100 steps), exits with status 143 (128 + SIGTERM: not a finished run), and the rerun
    continues exactly."""
    args = ("--every", "100", "--max-steps", "24")
    run_setup(tmp_path / "ref", "val-interval", *args)
    d = tmp_path / "preempted"
    proc = run_script(
        "setups.py",
        "--dir",
        str(d),
        "--out",
        str(d / "out.pt"),
        "--setup",
        "val-interval",
        *args,
        "--sigterm-at",
        "9",
        expect_rc=143,
    )
    steps = committed_steps(LocalTier(d / "snaps"))
    assert steps and 9 <= steps[0] <= 10, f"no snapshot of the preempted step: {steps}\n{proc.stderr[-2000:]}"
    assert f"SIGTERM: step {steps[0]} is held by" in proc.stderr + proc.stdout
    proc = run_setup(d, "val-interval", *args)
    assert_resumed(proc, steps[0], d / "snaps")
    assert_bitwise_equal(tmp_path / "ref" / "out.pt", d / "out.pt", since=steps[0])


@pytest.mark.slow
def test_a_rerun_of_a_fit_that_stopped_early_stops_there_and_a_longer_one_trains_on(tmp_path):
    """EarlyStopping stops the fit at step 16 of 40. The same command run again (a job requeued after it finished,
    or killed after its last snapshot) restores step 16 and stops there too, as the uninterrupted run did, saying
    why; run with a larger max_steps it trains on, as Lightning's own resume does."""
    d = tmp_path / "run"
    run_setup(d, "val-interval")
    first = torch.load(d / "out.pt", weights_only=True)
    assert first["global_step"] == 16, "the setup no longer stops early: the test needs a fit that stops early"
    proc = run_setup(d, "val-interval")
    assert_resumed(proc, 16, d / "snaps")
    assert "was taken after training was asked to stop" in proc.stdout + proc.stderr
    again = torch.load(d / "out.pt", weights_only=True)
    assert again.pop("last_batch").numel() == 0, "the rerun trained a batch"
    assert_same_run({k: v for k, v in first.items() if k != "last_batch"}, again, since=16)
    run_setup(d, "val-interval", "--max-steps", "48")
    longer = torch.load(d / "out.pt", weights_only=True)
    assert longer["global_step"] > 16 and longer["val_steps"][:4] == [4, 8, 12, 16], longer["val_steps"]
