"""torchrun's own restarts (``--max-restarts``): the relaunched processes of an attempt share torchrun's rendezvous
store with the attempts before, so every process group must form under keys of its own attempt. Real torchrun, real
processes, gloo, real SIGKILL of a different rank in three successive attempts."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import SCRIPTS, assert_bitwise_equal, restores, run_job

from lightning_snapshot.agent import stop_agent
from lightning_snapshot.backends import LocalTier
from lightning_snapshot.persist.writer import committed_steps

# RAM every 2 steps, local every 3: each kill comes when the RAM tier holds a newer step than the local tier
ARGS = ("--devices", "2", "--max-steps", "18", "--every", "3", "--ram-every", "2", "--shuffle", "--dropout", "0.1")
# (attempt, rank killed, step) and the step the next attempt must restore from the RAM tier
KILLS = [(0, 1, 5, 4), (1, 0, 11, 10), (2, 1, 14, 14)]


def _torchrun(
    base: Path, *args: str, max_restarts: int, common: tuple[str, ...] = ARGS
) -> subprocess.CompletedProcess[str]:
    env = {
        **os.environ,
        "PYTHONWARNINGS": "ignore::DeprecationWarning",
        "LIGHTNING_SNAPSHOT_SHM_DIR": str(base / "shm"),
    }
    env.pop("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", None)  # (torchrun's default: the store is shared by attempts)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        "--max-restarts",
        str(max_restarts),
        str(SCRIPTS / "train.py"),
        "--dir",
        str(base / "local"),
        "--out",
        str(base / "out.pt"),
        *common,
        *args,
    ]
    try:
        return run_job(cmd, 420, env)
    finally:
        for sock in list((base / "shm").glob("**/agent.sock")):
            stop_agent(sock.parent)


@pytest.mark.slow
def test_three_torchrun_restarts_each_form_their_groups_resume_from_ram_and_end_bitwise_equal(tmp_path):
    ref = _torchrun(tmp_path / "ref", max_restarts=0)
    assert ref.returncode == 0, ref.stderr[-4000:]
    plan = ",".join(f"{a}:{r}:{s}" for a, r, s, _ in KILLS)
    proc = _torchrun(tmp_path / "run", "--kill-plan", plan, max_restarts=3)
    said = proc.stdout + proc.stderr
    assert proc.returncode == 0, said[-6000:]
    assert "could not form the process group" not in said and "connectFullMesh" not in said, said[-6000:]
    # each attempt after the first resumed on both ranks, from the RAM tier's newest step (said as training started)
    for rank in (0, 1):
        mine = [(step, url) for step, url, r in restores(proc.stdout) if r == rank]
        assert mine == [(step, "ram://test?erasure=none") for *_, step in KILLS], (rank, restores(proc.stdout))
    for suffix in ("", ".rank1"):
        assert (
            assert_bitwise_equal(
                Path(f"{tmp_path / 'ref' / 'out.pt'}{suffix}"), Path(f"{tmp_path / 'run' / 'out.pt'}{suffix}")
            )
            > 0
        )


@pytest.mark.slow
def test_a_step_the_agents_wrote_to_the_local_tier_after_a_kill_is_resumed_from_the_ram_tier(tmp_path):
    """The RAM tier every step and a local tier every 3; rank 1 is SIGKILLed as its persist thread starts writing step
    12 to the RAM tier (once its agent holds step 12, staged and fenced), and its training thread waits at step 13 till
    then: the trainers never commit step 12 to the RAM tier, while the nodes' agents write it to the local tier from
    the RAM tier's memory. torchrun relaunches; the relaunch (once the agent flushed what the first attempt left it)
    must resume from step 12 of the RAM tier, not of the slower local tier, and the job end bitwise equal to one never
    killed."""
    common = (
        "--devices",
        "2",
        "--max-steps",
        "15",
        "--every",
        "3",
        "--ram-every",
        "1",
        "--shuffle",
        "--dropout",
        "0.1",
    )
    ref = _torchrun(tmp_path / "ref", max_restarts=0, common=common)
    assert ref.returncode == 0, ref.stderr[-4000:]
    proc = _torchrun(
        tmp_path / "run", "--kill-in-ram-write", "0:1:12", "--wait-agent-idle", max_restarts=1, common=common
    )
    said = proc.stdout + proc.stderr
    assert proc.returncode == 0, said[-6000:]
    assert "KILLED-IN-RAM-WRITE step=12 rank=1" in proc.stdout, said[-6000:]
    assert sorted(restores(proc.stdout)) == [(12, "ram://test?erasure=none", 0), (12, "ram://test?erasure=none", 1)], (
        restores(proc.stdout),
        said[-6000:],
    )
    # (the agents did write step 12 to the local tier: the relaunch could have taken it from there)
    assert 12 in committed_steps(LocalTier(tmp_path / "run" / "local"))
    for suffix in ("", ".rank1"):
        assert (
            assert_bitwise_equal(
                Path(f"{tmp_path / 'ref' / 'out.pt'}{suffix}"), Path(f"{tmp_path / 'run' / 'out.pt'}{suffix}")
            )
            > 0
        )
