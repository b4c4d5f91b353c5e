"""Preemption at the limits: a validation longer than the grace (one process with loader workers, 2-rank DDP and
ModelParallel under torchrun, the signal to one rank), the sanity check, averaged weights swapped in for validation,
and 8 ranks on 2 simulated nodes with the RAM tier erasure coded across them. Each preempted job must exit 143 within
the grace with its step durable, and its requeue must end bitwise equal to a job that was never interrupted."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import SCRIPTS, assert_bitwise_equal, restores, run_script
from test_preemption import HELD, _torchrun

from lightning_snapshot.backends import LocalTier
from lightning_snapshot.persist.writer import committed_steps

# (its own group: these jobs share a module fixture, and run beside test_preemption.py's on the other worker)
pytestmark = pytest.mark.xdist_group("preemption_limits")


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
    common = ("--devices", "2", "--max-steps", "24", "--val-every", "5", "--val-samples", "240", *LONG_VAL)
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
    common = ("--strategy", "mp", "--max-steps", "30", "--every", "10", "--samples", "400", "--val-every", "10")
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
