"""Preemption as clusters deliver it: SIGTERM to torchrun, to every process of the job, to one rank; during
validation; while an earlier snapshot is still being written to a slow tier. Real torchrun jobs (2 ranks, gloo, 2
loader workers per rank, dropout, a shuffled loader with random augmentation in the workers); each preempted job
must exit non-zero with the step the signal found durable, and the requeued job (the same command without the
signal) must resume from that step and end bitwise equal to a job that was never interrupted."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import SCRIPTS, assert_bitwise_equal, restores, run_job, run_script, slurm_job

from lightning_snapshot.backends import LocalTier
from lightning_snapshot.persist.writer import committed_steps

pytestmark = pytest.mark.xdist_group("preemption")

COMMON = (
    "--devices",
    "2",
    "--max-steps",
    "40",
    "--every",
    "10",
    "--shuffle",
    "--dropout",
    "0.1",
    "--workers",
    "2",
    "--augment",
)
VALIDATION = ("--val-every", "5")
HELD = re.compile(r"lightning-snapshot: (SIG\w+): step (\d+) is held by (.+?) \(([\d.]+) s after ")


def _torchrun(base: Path, *args: str, timeout: int = 240, script: str = "train.py") -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONWARNINGS": "ignore::DeprecationWarning"}
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        str(SCRIPTS / script),
        "--dir",
        str(base / "local"),
        "--out",
        str(base / "out.pt"),
        *args,
    ]
    return run_job(cmd, timeout, env)


@pytest.fixture(scope="module")
def references(tmp_path_factory) -> dict[str, Path]:
    """Uninterrupted runs: without validation, and with validation every 5 batches."""
    refs = {}
    for name, extra in (("plain", ()), ("validation", VALIDATION)):
        base = tmp_path_factory.mktemp(f"ref-{name}")
        proc = _torchrun(base, *COMMON, *extra)
        assert proc.returncode == 0, proc.stderr[-4000:]
        refs[name] = base
    return refs


def _lightning_ddp(base: Path, *args: str, timeout: int = 240) -> subprocess.CompletedProcess[str]:
    """The same job launched by Lightning itself (``python train.py``, strategy "ddp": rank 0 starts rank 1), as a
    container's main process often is."""
    env = {**os.environ, "PYTHONWARNINGS": "ignore::DeprecationWarning"}
    cmd = [
        sys.executable,
        str(SCRIPTS / "train.py"),
        "--dir",
        str(base / "local"),
        "--out",
        str(base / "out.pt"),
        *args,
    ]
    return run_job(cmd, timeout, env)


def _preempt_and_requeue(
    tmp_path: Path, ref: Path, extra: tuple[str, ...], signal_args: tuple[str, ...], signalled_at: int, launch=_torchrun
) -> int:
    """Run the job with the signal, check it stopped at the step the signal found with that step durable, requeue it
    and check the requeued job resumed there and ended bitwise equal to ``ref``. Returns the step."""
    run = tmp_path / "run"
    proc = launch(run, *COMMON, *extra, *signal_args)
    said = proc.stdout + proc.stderr
    assert proc.returncode != 0, f"a preempted job must not exit 0\n{said[-6000:]}"
    assert "DataLoader worker" not in said, said[-6000:]
    sent = [int(s) for s in re.findall(r"SIGNAL-SENT step=(\d+)", proc.stdout)]
    assert sent, said[-4000:]
    held = HELD.findall(said)
    assert held, f"no rank said the step was held\n{said[-6000:]}"
    step = int(held[0][1])
    # the step the job was at when the signal reached the ranks (torchrun forwards it some milliseconds later, and
    # these steps take about a millisecond): every rank stopped at that step, and it is the last step either trained
    assert sent[0] <= step <= sent[0] + 10 and signalled_at <= step, (sent, held)
    assert {int(h[1]) for h in held} == {step}, held
    for r in (0, 1):
        ended = [int(s) for s in re.findall(rf"STEP-END step=(\d+) rank={r}\n", proc.stdout)]
        assert ended and max(ended) == step, (r, ended, step)
    assert committed_steps(LocalTier(run / "local"))[0] == step
    # every rank exits with 128 + SIGTERM
    assert sorted(re.findall(r"EXITING status=(\d+) rank=(\d+)", proc.stdout)) == [("143", "0"), ("143", "1")], said
    requeued = launch(run, *COMMON, *extra)
    assert requeued.returncode == 0, (requeued.stdout + requeued.stderr)[-6000:]
    got = sorted(restores(requeued.stdout))
    assert got == [(step, str(run / "local"), 0), (step, str(run / "local"), 1)], got
    for suffix in ("", ".rank1"):
        assert (
            assert_bitwise_equal(Path(f"{ref / 'out.pt'}{suffix}"), Path(f"{run / 'out.pt'}{suffix}"), since=step) > 0
        )
    return step


@pytest.mark.slow
@pytest.mark.parametrize(
    "to,rank",
    [("launcher", 0), ("all", 0), ("self", 0), ("self", 1)],
    ids=["to-torchrun", "to-every-process", "to-rank0-only", "to-rank1-only"],
)
def test_sigterm_stops_every_rank_at_the_step_it_found_and_the_requeue_resumes_there(tmp_path, references, to, rank):
    _preempt_and_requeue(
        tmp_path, references["plain"], (), ("--signal-at", "23", "--signal-to", to, "--signal-rank", str(rank)), 23
    )


@pytest.mark.slow
def test_sigterm_to_the_main_process_of_a_job_lightning_launched(tmp_path, references):
    """``python train.py`` with strategy "ddp" on 2 devices (Lightning starts rank 1 from rank 0): SIGTERM to the
    main process only, as Kubernetes sends it; both ranks stop at the same step, exit 143, and the rerun resumes."""
    _preempt_and_requeue(
        tmp_path, references["plain"], (), ("--signal-at", "23", "--signal-to", "self"), 23, launch=_lightning_ddp
    )


@pytest.mark.slow
def test_sigterm_during_validation(tmp_path, references):
    """Validation runs after the 5th batch of each epoch (8 per rank): after steps 21, 29 and 37. The signal comes
    during the first batch of the validation after step 29, to every process (its loader workers included): the
    ranks abandon that validation, step 29 is made durable, and the requeue validates step 29 again."""
    step = _preempt_and_requeue(
        tmp_path,
        references["validation"],
        VALIDATION,
        ("--signal-at", "23", "--signal-during", "validation", "--signal-to", "all", "--val-delay", "0.2"),
        23,
    )
    assert 29 <= step <= 31, step  # (the step after the one the signal reached the ranks in)


@pytest.mark.slow
def test_sigterm_while_an_earlier_snapshot_is_written_to_a_slow_tier(tmp_path, references):
    """The local tier takes 1 s more per write (about 3 s a snapshot): the snapshot of step 20 is still being written
    when the signal comes at step 22; the preemption's snapshot waits for it and is durable within the grace."""
    step = _preempt_and_requeue(
        tmp_path, references["plain"], ("--slow-write", "1"), ("--signal-at", "22", "--signal-to", "launcher"), 22
    )
    # (torchrun forwards the signal some milliseconds later, and the ranks stop a step after it reached them)
    assert 22 < step <= 26, step


ONE = ("--max-steps", "30", "--every", "10", "--shuffle", "--dropout", "0.1", "--workers", "2", "--augment")


@pytest.fixture(scope="module")
def one_process_reference(tmp_path_factory) -> Path:
    base = tmp_path_factory.mktemp("ref-one")
    run_script("train.py", "--dir", str(base / "local"), "--out", str(base / "out.pt"), *ONE)
    return base


def _one(
    tmp_path: Path,
    ref: Path,
    *signal_args: str,
    rc: int = 143,
    env: dict[str, str] | None = None,
    expect_step: int | None = None,
) -> tuple[int, subprocess.CompletedProcess[str]]:
    """One process with 2 loader workers: preempted by ``signal_args``, exits with ``rc``, its step durable; the
    rerun resumes there and ends bitwise equal to ``ref``."""
    run = tmp_path / "run"
    args = ("--dir", str(run / "local"), "--out", str(run / "out.pt"), *ONE)
    saved = dict(os.environ)
    os.environ.update(env or {})
    try:
        proc = run_script("train.py", *args, *signal_args, expect_rc=rc)
    finally:
        os.environ.clear()
        os.environ.update(saved)
    said = proc.stdout + proc.stderr
    assert "DataLoader worker" not in said, said[-4000:]
    held = HELD.findall(said)
    assert len(held) == 1, said[-4000:]
    step = int(held[0][1])
    ended = [int(s) for s in re.findall(r"STEP-END step=(\d+) rank=0\n", proc.stdout)]
    assert ended and max(ended) == step, (ended, step)  # no step lost
    if expect_step is not None:
        assert step == expect_step, said[-3000:]
    assert committed_steps(LocalTier(run / "local"))[0] == step
    rerun = run_script("train.py", *args)
    assert restores(rerun.stdout) == [(step, str(run / "local"), 0)], rerun.stdout[-2000:]
    assert assert_bitwise_equal(ref / "out.pt", run / "out.pt", since=step) > 0
    return step, proc


@pytest.mark.slow
def test_one_process_with_loader_workers_sigterm_to_every_process(tmp_path, one_process_reference):
    """SIGTERM to the process and its 2 loader workers (a container stopped, SLURM signalling every process): the
    workers are not killed by it, the step is made durable, the exit status is 143."""
    _one(tmp_path, one_process_reference, "--signal-at", "13", "--signal-to", "tree", expect_step=13)


@pytest.mark.slow
def test_a_second_sigterm_during_the_snapshot_does_not_break_its_commit(tmp_path, one_process_reference):
    """The local tier writes slowly (0.3 s a write): a second SIGTERM comes 0.4 s later, in the middle of the
    preemption's snapshot; the commit completes and the process still exits 143."""
    _one(
        tmp_path,
        one_process_reference,
        "--signal-at",
        "13",
        "--signal-to",
        "tree",
        "--signal-again",
        "0.4",
        "--slow-write",
        "0.3",
        expect_step=13,
    )


@pytest.mark.slow
def test_a_signal_before_the_first_snapshot(tmp_path, one_process_reference):
    """Snapshots every 10 steps; SIGTERM at step 2: step 2 is snapshotted and the rerun resumes there."""
    _one(tmp_path, one_process_reference, "--signal-at", "2", "--signal-to", "self", expect_step=2)


@pytest.mark.slow
def test_slurm_auto_requeue_signal_snapshots_requeues_and_exits_138(tmp_path, one_process_reference):
    """Lightning's SLURM auto-requeue (SLURMEnvironment(auto_requeue=True), SIGUSR1): the callback owns SIGUSR1 too
    (not listed in preemption_signals), snapshots the step, runs ``scontrol requeue <job>`` once it is durable (a
    stand-in scontrol on PATH records its arguments), and the process exits 128 + SIGUSR1."""
    slurm, record = slurm_job(tmp_path)
    env = {**slurm, "LS_TEST_ZYGOTE": "0"}
    _one(
        tmp_path,
        one_process_reference,
        "--signal-at",
        "13",
        "--signal-to",
        "self",
        "--signal",
        "SIGUSR1",
        "--slurm-requeue",
        rc=128 + signal.SIGUSR1,
        env=env,
        expect_step=13,
    )
    assert record.read_text().split() == ["requeue", "4242"]


@pytest.mark.slow
def test_with_the_ram_tier_the_requeue_restores_from_node_memory(tmp_path, references):
    """RAM tier every step (its agents outlive the job), local tier every 10: SIGTERM to torchrun at step 23. The
    step the signal found, already due in the RAM tier, is captured once (on each rank) for every tier; the requeue
    on the same node restores it from the RAM tier, on both ranks, and ends bitwise equal."""
    from lightning_snapshot.agent import stop_agent

    run = tmp_path / "run"
    os.environ["LIGHTNING_SNAPSHOT_SHM_DIR"] = str(tmp_path / "shm")
    try:
        proc = _torchrun(
            run, *COMMON, "--ram-every", "1", "--signal-at", "23", "--signal-to", "launcher", "--print-captures"
        )
        said = proc.stdout + proc.stderr
        assert proc.returncode != 0, said[-6000:]
        held = HELD.findall(said)
        assert held, said[-6000:]
        step = int(held[0][1])
        assert step >= 23 and committed_steps(LocalTier(run / "local"))[0] == step, (held, said[-3000:])
        # the RAM tier's snapshot of that step is the one made durable: each rank captured the step once
        captures = re.findall(rf"CAPTURE step={step} rank=(\d+)\n", proc.stdout)
        assert sorted(captures) == ["0", "1"], (captures, proc.stdout[-3000:])
        requeued = _torchrun(run, *COMMON, "--ram-every", "1")
        assert requeued.returncode == 0, (requeued.stdout + requeued.stderr)[-6000:]
    finally:
        os.environ.pop("LIGHTNING_SNAPSHOT_SHM_DIR")
        for sock in list((tmp_path / "shm").glob("**/agent.sock")):
            stop_agent(sock.parent)
    got = sorted(restores(requeued.stdout))
    assert got == [(step, "ram://test?erasure=none", 0), (step, "ram://test?erasure=none", 1)], got
    for suffix in ("", ".rank1"):
        assert (
            assert_bitwise_equal(
                Path(f"{references['plain'] / 'out.pt'}{suffix}"), Path(f"{run / 'out.pt'}{suffix}"), since=step
            )
            > 0
        )


@pytest.mark.slow
@pytest.mark.parametrize("during", ["backward", "accumulating"])
def test_a_signal_mid_step_snapshots_the_last_whole_optimizer_step(tmp_path, during):
    """SIGTERM in the middle of a step (right after its backward), and with gradients accumulated over 3 batches
    after a batch that does not step: the snapshot is of a whole optimizer step, never of a half-done one, and the
    rerun ends bitwise equal to an uninterrupted run with the same accumulation."""
    accumulate = ("--accumulate", "3") if during == "accumulating" else ()
    ref = tmp_path / "ref"
    run_script("train.py", "--dir", str(ref / "local"), "--out", str(ref / "out.pt"), *ONE, *accumulate)
    step, proc = _one(tmp_path, ref, *accumulate, "--signal-at", "5", "--signal-to", "self", "--signal-during", during)
    # (sent during the step after step S, whose optimizer step then completes: that step is the one snapshotted)
    sent = int(re.search(r"SIGNAL-SENT step=(\d+) ", proc.stdout).group(1))
    assert sent >= 5 and step == sent + 1, (step, proc.stdout[-2000:])


@pytest.mark.slow
def test_ddp_spawn_preempted_rank_stops_both_and_the_launcher_exits_143(tmp_path):
    """ddp_spawn: rank 1 alone gets SIGTERM after step 5; both ranks stop at the same step with it durable, and the
    launching process (where no fit runs) exits 143 like its ranks instead of 1 (torch's ProcessExitedException).
    The rerun resumes there and finishes."""
    proc = run_script("preempt_spawn.py", "--dir", str(tmp_path / "snaps"), expect_rc=143)
    said = proc.stdout + proc.stderr
    held = HELD.findall(said)
    assert held and int(held[0][1]) in (5, 6), said[-3000:]
    step = int(held[0][1])
    assert committed_steps(LocalTier(tmp_path / "snaps"))[0] == step
    assert "FIT RETURNED" not in proc.stdout
    rerun = run_script("preempt_spawn.py", "--dir", str(tmp_path / "snaps"), "--no-signal")
    assert "FIT RETURNED" in rerun.stdout
    assert committed_steps(LocalTier(tmp_path / "snaps"))[0] == 12


@pytest.mark.slow
def test_preemption_with_a_local_and_an_object_store_tier(tmp_path, s3_server, bucket, one_process_reference):
    """A local tier and an object store (moto on 127.0.0.1), both every 10 steps: SIGTERM at step 13 makes step 13
    durable in both (the bytes in the bucket are the step's), and the rerun resumes it bitwise."""
    from train import s3_options

    from lightning_snapshot.backends import ObjectStoreTier

    url = f"s3://{bucket}/run"
    step, proc = _one(
        tmp_path,
        one_process_reference,
        "--signal-at",
        "13",
        "--signal-to",
        "tree",
        "--s3",
        url,
        "--endpoint",
        s3_server.endpoint,
        expect_step=13,
    )
    store = ObjectStoreTier(url, storage_options=s3_options(s3_server.endpoint))
    assert committed_steps(store)[0] == 13
    assert f"step 13 is held by {tmp_path / 'run' / 'local'}, {url}" in proc.stdout + proc.stderr


@pytest.mark.slow
def test_model_parallel_sigterm_to_one_rank_stops_both_and_the_requeue_resumes_bitwise(tmp_path):
    """ModelParallelStrategy (FSDP2, each rank holding half of every parameter) under torchrun: SIGTERM to rank 1
    only after step 23. Both ranks stop at the step after it with their shards durable, exit 143, and the requeue
    resumes there and ends bitwise equal to a job that was never interrupted."""
    common = ("--strategy", "mp", "--max-steps", "40", "--every", "10", "--samples", "400")

    def job(base: Path, *args: str) -> subprocess.CompletedProcess[str]:
        return _torchrun(base, *args, script="reshard_train.py")

    ref = job(tmp_path / "ref", *common)
    assert ref.returncode == 0, ref.stderr[-4000:]
    run = tmp_path / "run"
    proc = job(run, *common, "--signal-at", "23", "--signal-to", "self", "--signal-rank", "1")
    said = proc.stdout + proc.stderr
    assert proc.returncode != 0, said[-6000:]
    held = HELD.findall(said)
    assert {int(h[1]) for h in held} == {24}, said[-6000:]
    # torchrun's summary of its failed workers: both ranks exited non-zero, 143, or -15 for a rank torchrun itself
    # sent SIGTERM while it was exiting, once the other had exited 143; neither trained past the step made durable
    codes = re.findall(r"exitcode\s*: (-?\d+) \(pid", said)
    assert len(codes) == 2 and "143" in codes and set(codes) <= {"143", "-15"}, said[-3000:]
    for r in (0, 1):
        assert max(int(s) for s in re.findall(rf"STEP-END step=(\d+) rank={r}\n", proc.stdout)) == 24, said[-3000:]
    assert committed_steps(LocalTier(run / "local"))[0] == 24
    requeued = job(run, *common)
    assert requeued.returncode == 0, requeued.stderr[-4000:]
    assert sorted(re.findall(r"RESTORED step=(\d+) rank=(\d)", requeued.stdout)) == [("24", "0"), ("24", "1")]
    assert assert_bitwise_equal(tmp_path / "ref" / "out.pt", run / "out.pt", since=24) > 0


@pytest.mark.slow
def test_a_rank_late_at_a_step_boundary_by_more_than_collective_timeout_does_not_fail_the_agreement(tmp_path):
    """Rank 0 alone works 8 s after step 5 (an evaluation in a rank-zero callback) while rank 1 goes on and waits in
    the next step's collectives; collective_timeout is 3 s. The per-step preemption agreement waits as long as the
    trainer's own collectives do (Lightning's 30 min), not collective_timeout: the job trains to the end and its
    snapshots commit (it failed with gloo's 'Timed out waiting 3000ms' when the agreement used collective_timeout)."""
    proc = _torchrun(
        tmp_path,
        "--devices",
        "2",
        "--max-steps",
        "12",
        "--every",
        "2",
        "--collective-timeout",
        "3",
        "--rank0-delay",
        "5:8",
    )
    said = proc.stdout + proc.stderr
    assert proc.returncode == 0, said[-6000:]
    assert "Timed out" not in said, said[-6000:]
    assert committed_steps(LocalTier(tmp_path / "local"))[0] == 12


# ------------------------------------------------------------------------------------------ a validation longer than the grace
# validation every 8 steps in one process (16 batches an epoch: after steps 8, 16, 24), every 5 in 2-rank DDP (8
# batches an epoch per rank: after steps 5, 13, 21); each validation is 30 batches of 0.25 s per rank (7.5 s), longer
# than sigterm_grace=5; ModelCheckpoint keeps the 2 best val_loss checkpoints, EarlyStopping watches val_loss, and
# every value logged is compared
LONG_VAL = (
    "--every",
    "10",
    "--shuffle",
    "--dropout",
    "0.1",
    "--workers",
    "2",
    "--augment",
    "--val-monitor",
    "--val-delay",
    "0.25",
    "--sigterm-grace",
    "5",
)
EXITED = re.compile(r"EXITING status=(\d+) rank=(\d+) at=([\d.]+)")
SENT_AT = re.compile(r"SIGNAL-SENT step=(\d+) to=\S+ at=([\d.]+)")


@pytest.fixture(scope="module")
def long_validation_reference(tmp_path_factory) -> Path:
    base = tmp_path_factory.mktemp("ref-long-val")
    run_script(
        "train.py",
        "--dir",
        str(base / "local"),
        "--out",
        str(base / "out.pt"),
        "--max-steps",
        "30",
        "--val-every",
        "8",
        "--val-samples",
        "120",
        *LONG_VAL,
    )
    return base


def _abandoned_within_grace(proc: subprocess.CompletedProcess[str], ranks: int) -> tuple[int, int]:
    """The preempted run: every rank exited 143 within the grace of the signal, having abandoned the validation
    (it ran at most a few of its 30 batches after the signal). Returns (the step the signal came after, the step
    held)."""
    said = proc.stdout + proc.stderr
    sent = SENT_AT.search(proc.stdout)
    assert sent, said[-4000:]
    signalled, sent_at = int(sent.group(1)), float(sent.group(2))
    exits = EXITED.findall(proc.stdout)
    assert sorted((s, r) for s, r, _ in exits) == [("143", str(r)) for r in range(ranks)], said[-4000:]
    for _, rank, at in exits:
        assert float(at) - sent_at < 5, (rank, float(at) - sent_at)  # within sigterm_grace
    after = proc.stdout.count("VAL-BATCH-AFTER-SIGNAL")
    assert after < 10 * ranks, (after, said[-3000:])  # (the validation had 29 batches to go on each rank)
    held = HELD.findall(said)
    assert held and {int(h[1]) for h in held} == {signalled}, (held, signalled)
    return signalled, int(held[0][1])


@pytest.mark.slow
@pytest.mark.parametrize("at", [5, 16], ids=["mid-epoch", "end-of-epoch"])
def test_sigterm_in_a_validation_longer_than_the_grace_one_process(tmp_path, long_validation_reference, at):
    """One process with 2 loader workers, SIGTERM to it and its workers during the first batch of the validation
    after step 8 (mid-epoch) or step 16 (the epoch's last batch: its validation, then the epoch's end): the
    validation is abandoned, the step before it is durable, the process exits 143 within the grace; the requeue
    validates that step again in full and ends bitwise equal, ModelCheckpoint's files and state, EarlyStopping's
    state and every logged value included."""
    run = tmp_path / "run"
    args = ("--dir", str(run / "local"), "--out", str(run / "out.pt"), "--max-steps", "30", "--val-every", "8")
    args += ("--val-samples", "120", *LONG_VAL)
    proc = run_script(
        "train.py", *args, "--signal-at", str(at), "--signal-during", "validation", "--signal-to", "tree", expect_rc=143
    )
    assert "DataLoader worker" not in proc.stdout + proc.stderr
    signalled, step = _abandoned_within_grace(proc, 1)
    assert step == (8 if at == 5 else 16)
    assert committed_steps(LocalTier(run / "local"))[0] == step
    # no trace of the abandoned validation: ModelCheckpoint saved nothing for it
    saved = sorted(p.name for p in (run / "ckpts").iterdir()) if (run / "ckpts").exists() else []
    assert saved == ([] if step == 8 else ["step=8.ckpt"]), saved
    rerun = run_script("train.py", *args)
    assert restores(rerun.stdout) == [(step, str(run / "local"), 0)], rerun.stdout[-2000:]
    assert assert_bitwise_equal(long_validation_reference / "out.pt", run / "out.pt", since=step) > 0


@pytest.mark.slow
def test_sigterm_in_a_validation_with_averaged_weights_swapped_in(tmp_path):
    """EMAWeightAveraging validates with the averaged weights swapped into the model (and back at the validation's
    epoch end): a validation abandoned after step 8 snapshots the trained weights, not the averaged ones, and the
    requeue ends bitwise equal, the averaged model included."""
    common = ("--max-steps", "24", "--val-every", "8", "--val-samples", "120", *LONG_VAL, "--ema")
    ref = tmp_path / "ref"
    run_script("train.py", "--dir", str(ref / "local"), "--out", str(ref / "out.pt"), *common)
    run = tmp_path / "run"
    args = ("--dir", str(run / "local"), "--out", str(run / "out.pt"), *common)
    proc = run_script(
        "train.py", *args, "--signal-at", "5", "--signal-during", "validation", "--signal-to", "tree", expect_rc=143
    )
    _, step = _abandoned_within_grace(proc, 1)
    assert step == 8
    rerun = run_script("train.py", *args)
    assert restores(rerun.stdout) == [(8, str(run / "local"), 0)], rerun.stdout[-2000:]
    assert assert_bitwise_equal(ref / "out.pt", run / "out.pt", since=8) > 0


@pytest.mark.slow
def test_sigterm_to_rank_1_in_a_validation_longer_than_the_grace_ddp(tmp_path):
    """2-rank DDP under torchrun, 2 loader workers each: SIGTERM to rank 1 alone during the validation after step 13.
    Rank 0 learns it without a collective per batch (the store), both ranks abandon the validation at whatever batch
    they are, agree once, make step 13 durable and exit 143 within the grace; the requeue validates step 13 again and
    ends bitwise equal on both ranks."""
    # (16 steps: validations after steps 5 and 13 only, the one the signal comes in the last)
    common = ("--devices", "2", "--max-steps", "16", "--val-every", "5", "--val-samples", "240", *LONG_VAL)
    ref = tmp_path / "ref"
    assert _torchrun(ref, *common).returncode == 0
    run = tmp_path / "run"
    proc = _torchrun(run, *common, "--signal-at", "10", "--signal-during", "validation", "--signal-rank", "1")
    assert proc.returncode != 0
    signalled, step = _abandoned_within_grace(proc, 2)
    assert step == 13
    assert committed_steps(LocalTier(run / "local"))[0] == step
    requeued = _torchrun(run, *common)
    assert requeued.returncode == 0, (requeued.stdout + requeued.stderr)[-6000:]
    assert sorted(restores(requeued.stdout)) == [(13, str(run / "local"), 0), (13, str(run / "local"), 1)]
    for suffix in ("", ".rank1"):
        assert assert_bitwise_equal(Path(f"{ref / 'out.pt'}{suffix}"), Path(f"{run / 'out.pt'}{suffix}"), since=13) > 0


@pytest.mark.slow
def test_model_parallel_sigterm_to_rank_1_in_a_validation_longer_than_the_grace(tmp_path):
    """ModelParallelStrategy (FSDP2) under torchrun, validation after every 10th step (30 batches of 0.25 s per rank),
    SIGTERM to rank 1 alone in the validation after step 20: the ranks stop that validation before the same batch
    (each says in the store how many it started; a sharded forward may be a collective), step 20 is durable, both
    exit 143 within the grace, and the requeue validates step 20 again and ends bitwise equal."""
    # (22 steps: validations after steps 10 and 20 only, the one the signal comes in the last)
    common = ("--strategy", "mp", "--max-steps", "22", "--every", "10", "--samples", "400", "--val-every", "10")
    common += ("--val-samples", "240", "--val-delay", "0.25", "--sigterm-grace", "5")

    def job(base: Path, *args: str) -> subprocess.CompletedProcess[str]:
        return _torchrun(base, *args, script="reshard_train.py")

    ref = job(tmp_path / "ref", *common)
    assert ref.returncode == 0, ref.stderr[-4000:]
    run = tmp_path / "run"
    proc = job(run, *common, "--signal-at", "12", "--signal-during", "validation", "--signal-rank", "1")
    assert proc.returncode != 0
    _, step = _abandoned_within_grace(proc, 2)
    assert step == 20 and committed_steps(LocalTier(run / "local"))[0] == 20
    requeued = job(run, *common)
    assert requeued.returncode == 0, requeued.stderr[-4000:]
    assert sorted(re.findall(r"RESTORED step=(\d+) rank=(\d)", requeued.stdout)) == [("20", "0"), ("20", "1")]
    assert assert_bitwise_equal(tmp_path / "ref" / "out.pt", run / "out.pt", since=20) > 0


@pytest.mark.slow
def test_a_training_step_longer_than_the_grace(tmp_path, one_process_reference):
    """SIGTERM during the step after step 15, which then takes 30 s (grace 6 s): the step boundary never comes in
    time, so the newest snapshot already captured (step 10) is what is durable, one error line says so and how many
    steps are lost, and the process exits 143 within the grace; the rerun resumes from step 10, bitwise."""
    run = tmp_path / "run"
    args = ("--dir", str(run / "local"), "--out", str(run / "out.pt"), *ONE, "--sigterm-grace", "6")
    proc = run_script(
        "train.py",
        *args,
        "--signal-at",
        "15",
        "--signal-during",
        "backward",
        "--signal-to",
        "tree",
        "--train-delay",
        "15:30",
        expect_rc=143,
    )
    said = proc.stdout + proc.stderr
    assert "SLOW-STEP step=15" in proc.stdout, said[-3000:]
    assert (
        "lightning-snapshot: SIGTERM: the job was at step 15 and could not reach the next step boundary within"
        " sigterm_grace=6 s (a training step, validation batch or hook outlasted it): step 10 is the newest durable"
        " snapshot; 5 step(s) lost"
    ) in said, said[-3000:]
    assert said.count("could not reach the next step boundary") == 1
    assert committed_steps(LocalTier(run / "local"))[0] == 10
    rerun = run_script("train.py", *args)
    assert restores(rerun.stdout) == [(10, str(run / "local"), 0)], rerun.stdout[-2000:]
    assert assert_bitwise_equal(one_process_reference / "out.pt", run / "out.pt", since=10) > 0


@pytest.mark.slow
def test_sigterm_in_an_epoch_end_hook(tmp_path, one_process_reference):
    """SIGTERM from an ``on_train_epoch_end`` hook after step 16 (the first epoch's last step): the ranks stop between
    the epochs, step 16 is durable, and the rerun starts the second epoch from it, bitwise."""
    step, _ = _one(
        tmp_path, one_process_reference, "--signal-at", "10", "--signal-during", "epoch_end", "--signal-to", "tree"
    )
    assert step == 16


@pytest.mark.slow
def test_sigterm_during_the_sanity_check(tmp_path):
    """SIGTERM during the sanity check of a fresh run: nothing was trained, the check is abandoned and the process
    exits 143 at once; the rerun starts from the beginning and ends bitwise equal to an uninterrupted run."""
    common = ("--max-steps", "12", "--val-every", "8", "--val-samples", "120", "--sanity", "20", *LONG_VAL)
    ref = tmp_path / "ref"
    run_script("train.py", "--dir", str(ref / "local"), "--out", str(ref / "out.pt"), *common)
    run = tmp_path / "run"
    args = ("--dir", str(run / "local"), "--out", str(run / "out.pt"), *common)
    proc = run_script("train.py", *args, "--signal-at", "0", "--signal-during", "validation", expect_rc=143)
    said = proc.stdout + proc.stderr
    assert "at step 0, where this fit started; nothing to snapshot" in said, said[-3000:]
    assert proc.stdout.count("VAL-BATCH-AFTER-SIGNAL") < 10, said[-3000:]
    assert committed_steps(LocalTier(run / "local")) == []
    rerun = run_script("train.py", *args)
    assert restores(rerun.stdout) == []
    assert assert_bitwise_equal(ref / "out.pt", run / "out.pt") > 0


# ------------------------------------------------------------------------------------------ 8 ranks on 2 nodes
def _torchrun_nodes(base: Path, *args: str, nodes: int = 2, per_node: int = 4, timeout: int = 400) -> list[str]:
    """One torchrun launcher per simulated node (static rendezvous on 127.0.0.1, each node its own memory directory
    for the RAM tier's agent and its own disk for the local tier); returns each launcher's output."""
    from conftest import rendezvous_port

    port = rendezvous_port()
    procs = []
    for node in range(nodes):
        env = {
            **os.environ,
            "PYTHONWARNINGS": "ignore::DeprecationWarning",
            "LIGHTNING_SNAPSHOT_SHM_DIR": str(base / "shm" / f"node{node}"),
        }
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(nodes), "--node-rank", str(node)]
        cmd += ["--nproc-per-node", str(per_node), "--master-addr", "127.0.0.1", "--master-port", str(port)]
        cmd += [
            str(SCRIPTS / "train.py"),
            "--dir",
            str(base / "local" / "node{node_rank}"),
            "--out",
            str(base / "out.pt"),
        ]
        cmd += ["--devices", str(per_node), "--num-nodes", str(nodes), *args]
        procs.append(
            subprocess.Popen(
                cmd, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True
            )
        )
    out = []
    try:
        for p in procs:
            out.append(p.communicate(timeout=timeout)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
    return out


@pytest.mark.slow
def test_eight_ranks_on_two_nodes_sigterm_to_each_launcher_requeue_from_node_memory(tmp_path):
    """2 simulated nodes x 4 DDP ranks under torchrun, the RAM tier erasure coded 1+1 across the nodes (every step)
    and each node's own disk (every 10 steps): SIGTERM to each node's torchrun after step 8. Every rank stops at the
    same step with it durable and exits 143; the requeue restores that step from node memory on all 8 ranks and ends
    bitwise equal to an uninterrupted run."""
    from lightning_snapshot.agent import stop_agent

    common = ("--max-steps", "16", "--every", "10", "--shuffle", "--dropout", "0.1", "--augment")
    common += ("--ram-every", "1", "--ram-erasure", "1+1")
    try:
        ref = tmp_path / "ref"
        said = _torchrun_nodes(ref, *common)
        assert all("EXITING" not in s for s in said) and (ref / "out.pt.rank7").exists(), said[0][-3000:]
        run = tmp_path / "run"
        said = "".join(_torchrun_nodes(run, *common, "--signal-at", "8", "--signal-to", "launchers"))
        held = HELD.findall(said)
        assert held, said[-6000:]
        step = int(held[0][1])
        assert 8 <= step <= 12, held
        assert sorted(re.findall(r"EXITING status=(\d+) rank=(\d+)", said)) == sorted(
            ("143", str(r)) for r in range(8)
        ), said[-6000:]
        for r in range(8):  # no rank trained past the step held
            ended = [int(s) for s in re.findall(rf"STEP-END step=(\d+) rank={r}\n", said)]
            assert ended and max(ended) == step, (r, ended, step)
        requeued = "".join(_torchrun_nodes(run, *common))
    finally:
        for sock in list(tmp_path.glob("*/shm/**/agent.sock")):
            stop_agent(sock.parent)
    assert sorted(restores(requeued)) == [(step, "ram://test?erasure=1+1", r) for r in range(8)], requeued[-4000:]
    for r in range(8):
        suffix = f".rank{r}" if r else ""
        assert (
            assert_bitwise_equal(Path(f"{ref / 'out.pt'}{suffix}"), Path(f"{run / 'out.pt'}{suffix}"), since=step) > 0
        )
