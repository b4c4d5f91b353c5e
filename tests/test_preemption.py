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
from conftest import SCRIPTS, assert_bitwise_equal, restores, run_script

from lightning_snapshot.backends import LocalTier
from lightning_snapshot.writer import committed_steps

pytestmark = pytest.mark.xdist_group("preemption")

COMMON = ("--devices", "2", "--max-steps", "30", "--every", "10", "--shuffle", "--dropout", "0.1", "--workers", "2",
          "--augment")
VALIDATION = ("--val-every", "5")
HELD = re.compile(r"lightning-snapshot: (SIG\w+): step (\d+) is held by (\S+) \(([\d.]+) s after the signal\)")


def _torchrun(base: Path, *args: str, timeout: int = 240) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONWARNINGS": "ignore::DeprecationWarning"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(SCRIPTS / "train.py"), "--dir", str(base / "local"), "--out", str(base / "out.pt"), *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, start_new_session=True)


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


def _preempt_and_requeue(tmp_path: Path, ref: Path, extra: tuple[str, ...], signal_args: tuple[str, ...],
                         signalled_at: int) -> int:
    """Run the job with the signal, check it stopped at the step the signal found with that step durable, requeue it
    and check the requeued job resumed there and ended bitwise equal to ``ref``. Returns the step."""
    run = tmp_path / "run"
    proc = _torchrun(run, *COMMON, *extra, *signal_args)
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
    requeued = _torchrun(run, *COMMON, *extra)
    assert requeued.returncode == 0, (requeued.stdout + requeued.stderr)[-6000:]
    got = sorted(restores(requeued.stdout))
    assert got == [(step, str(run / "local"), 0), (step, str(run / "local"), 1)], got
    for suffix in ("", ".rank1"):
        assert assert_bitwise_equal(Path(f"{ref / 'out.pt'}{suffix}"), Path(f"{run / 'out.pt'}{suffix}"),
                                    since=step) > 0
    return step


@pytest.mark.slow
@pytest.mark.parametrize(
    "to,rank",
    [("launcher", 0), ("all", 0), ("self", 0), ("self", 1)],
    ids=["to-torchrun", "to-every-process", "to-rank0-only", "to-rank1-only"],
)
def test_sigterm_stops_every_rank_at_the_step_it_found_and_the_requeue_resumes_there(tmp_path, references, to, rank):
    _preempt_and_requeue(tmp_path, references["plain"], (),
                         ("--signal-at", "23", "--signal-to", to, "--signal-rank", str(rank)), 23)


@pytest.mark.slow
def test_sigterm_during_validation(tmp_path, references):
    """Validation runs after the 5th batch of each epoch (8 per rank): after steps 21 and 29. The signal comes during
    the first batch of the validation after step 29, to every process: the ranks finish validation, stop before the
    next batch, and the snapshot is of step 29 after its validation (the requeue does not validate again)."""
    step = _preempt_and_requeue(tmp_path, references["validation"], VALIDATION,
                                ("--signal-at", "23", "--signal-during", "validation", "--signal-to", "all",
                                 "--val-delay", "0.2"), 23)
    assert step == 29


@pytest.mark.slow
def test_sigterm_while_an_earlier_snapshot_is_written_to_a_slow_tier(tmp_path, references):
    """The local tier takes 1 s more per write (about 3 s a snapshot): the snapshot of step 20 is still being written
    when the signal comes at step 22; the preemption's snapshot waits for it and is durable within the grace."""
    step = _preempt_and_requeue(tmp_path, references["plain"], ("--slow-write", "1"),
                                ("--signal-at", "22", "--signal-to", "launcher"), 22)
    assert step in (22, 23)
