"""RAM tier and snapshot agent: real processes, real SIGKILL, gloo between simulated nodes."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import SCRIPTS, assert_bitwise_equal, check_flush_after_death, launch_nodes, run_script, run_train
from conftest import wait_until as _wait

from lightning_snapshot.agent import agent_log_path, agent_status, ensure_agent, stop_agent
from lightning_snapshot.backends import LocalTier
from lightning_snapshot.persist.writer import committed_steps
from lightning_snapshot.restore.loader import read_manifest
from lightning_snapshot.staging.arena import FAKE_REGISTER_ENV


# ------------------------------------------------------------------------------------------------ the agent
def test_one_agent_per_node_and_run_in_its_own_session_owner_only(shm):
    node = shm / "run-a"
    pid = ensure_agent(node, idle_timeout=60)
    assert ensure_agent(node, idle_timeout=60) == pid, "a second start must find the running agent"
    assert os.getsid(pid) != os.getsid(0), "the agent must not share the trainer's session"
    assert stat.S_IMODE(os.stat(node).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(node / "agent.sock").st_mode) == 0o600
    # a second agent for the same directory refuses to start and says who serves it
    proc = subprocess.run(
        [sys.executable, "-m", "lightning_snapshot.cli.main", "agent", "--dir", str(node)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 3 and f"another agent (pid {pid}) already serves" in proc.stderr
    (node / "store").mkdir()
    (node / "store" / "x").write_bytes(b"held")
    (node / "job-notes.txt").write_text("a file the agent does not own")
    assert agent_status(node)["pid"] == pid
    assert stop_agent(node)
    assert _wait(lambda: not os.path.exists(f"/proc/{pid}"))
    # it freed the memory and removed what it owns, and nothing else: the directory stays for the other file
    assert sorted(p.name for p in node.iterdir()) == ["job-notes.txt"]
    assert sorted(p.name for p in shm.iterdir()) == ["run-a"]


def test_agent_exits_when_idle_and_leaves_nothing_in_shared_memory(shm):
    node = shm / "run-b"
    pid = ensure_agent(node, idle_timeout=1.0)
    (node / "store" / "step-000000000002").mkdir(parents=True)
    (node / "store" / "step-000000000002" / "0.bin").write_bytes(b"x" * 5000)
    st = agent_status(node)
    assert st["snapshots"][0]["step"] == 2 and 0 <= st["exits_in_s"] <= 1.0 and st["idle_timeout_s"] == 1.0
    assert _wait(lambda: not os.path.exists(f"/proc/{pid}"), timeout=30), "idle agent did not exit"
    # socket, lock, memory, its directory and the (then empty) base directory are gone; the log is kept elsewhere
    assert not shm.exists(), sorted(str(p) for p in shm.rglob("*"))
    assert "no trainer attached for 1 s: exiting" in agent_log_path(node).read_text()


def test_an_agent_whose_directory_another_job_replaced_exits_and_deletes_nothing(shm):
    node = shm / "run-r"
    pid = ensure_agent(node, idle_timeout=60)
    node.rename(shm / "moved")  # another job deletes the directory and makes its own, with files of the same names
    (node / "store").mkdir(parents=True)
    for name in ("agent.lock", "agent.sock", "store/x"):
        (node / name).write_text("not the agent's")
    assert _wait(lambda: not os.path.exists(f"/proc/{pid}"), timeout=30), "the agent did not notice"
    assert sorted(str(p.relative_to(node)) for p in node.rglob("*")) == ["agent.lock", "agent.sock", "store", "store/x"]
    assert sorted(p.name for p in (shm / "moved").iterdir()) == ["agent.lock", "agent.sock"]
    assert "was removed or taken over: exiting without touching it" in agent_log_path(node).read_text()


def test_the_lock_refuses_a_second_agent_and_follows_a_replaced_lock_file(tmp_path, capsys):
    from lightning_snapshot.backends.ram.agent_protocol import take_lock

    first = take_lock(tmp_path, tmp_path / "first.log")
    assert first is not None and (tmp_path / "agent.lock").read_text() == f"{os.getpid()}\n{tmp_path / 'first.log'}\n"
    assert take_lock(tmp_path, None) is None  # (a second open file description: refused like another process)
    assert f"another agent (pid {os.getpid()}) already serves {tmp_path}" in capsys.readouterr().err
    # the first agent exits: it deletes the lock file while holding it; the next agent locks a new file, not the
    # deleted one (which would let a third one in beside it)
    os.unlink(tmp_path / "agent.lock")
    second = take_lock(tmp_path, None)
    assert second is not None and os.fstat(second).st_ino == os.stat(tmp_path / "agent.lock").st_ino
    assert take_lock(tmp_path, None) is None
    os.close(first)
    os.close(second)


def _cli(*args: str) -> tuple[int, str, str]:
    """``lightning-snapshot ARGS`` in this process: (exit status, stdout, stderr)."""
    import contextlib
    import io

    from lightning_snapshot.cli.main import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(list(args))
    return rc, out.getvalue(), err.getvalue()


def test_agent_status_readable_and_json_then_stop_leaves_nothing_in_shared_memory(tmp_path, shm):
    import json

    from lightning_snapshot.agent import AgentClient

    node = shm / "run-s"
    pid = ensure_agent(node, idle_timeout=300)
    for step, nbytes in ((8, 8192), (4, 4096)):  # what the RAM tier holds (its files, as the trainer writes them)
        (node / "store" / f"step-{step:012d}").mkdir(parents=True)
        (node / "store" / f"step-{step:012d}" / "0.bin").write_bytes(b"x" * nbytes)
    client = AgentClient(node, rank=0, world_size=1, run_id="run-s-id", tiers=[LocalTier(tmp_path / "local")])
    try:
        assert _wait(lambda: agent_status(node)["attached"] == 1)
        rc, out, err = _cli("agent", "--dir", str(node), "--status", "--json")
        assert rc == 0 and err == ""
        st = json.loads(out)
        assert sorted(st) == [
            "attached",
            "dir",
            "exits_in_s",
            "flushing",
            "held_bytes",
            "idle_s",
            "idle_timeout_s",
            "log",
            "pending",
            "pid",
            "snapshots",
            "started_unix",
            "trainers",
            "uptime_s",
            "version",
        ]
        assert st["version"] == 1 and st["pid"] == pid and st["dir"] == str(node) and st["attached"] == 1
        assert st["trainers"] == [{"rank": 0, "pid": os.getpid(), "world_size": 1, "run_id": "run-s-id"}]
        assert [e["step"] for e in st["snapshots"]] == [8, 4] and st["snapshots"][0]["bytes"] >= 8192
        assert st["held_bytes"] == sum(e["bytes"] for e in st["snapshots"])
        assert st["idle_timeout_s"] == 300 and st["idle_s"] is None and st["exits_in_s"] is None
        assert st["log"] == str(agent_log_path(node)) and st["pending"] == [] and st["flushing"] == 0
        assert 0 <= st["uptime_s"] < 600 and abs(st["started_unix"] - __import__("time").time()) < 600
        rc, out, err = _cli("agent", "--dir", str(node), "--status")
        assert rc == 0 and err == ""
        lines = out.splitlines()
        assert lines[0] == f"agent pid {pid} serving {node}"
        assert lines[1].startswith("  up ") and " s (since " in lines[1]
        assert lines[2] == f"  trainers attached: 1 (rank 0 pid {os.getpid()})"
        assert lines[3].startswith("  memory held: ") and lines[3].endswith(" KiB in 2 snapshots")
        assert lines[4].startswith("    step 8: ") and lines[5].startswith("    step 4: ")
        assert (
            lines[6] == "  idle timeout: 5 min 00 s (counts once no trainer is attached and nothing is being written)"
        )
        assert lines[7] == f"  log: {agent_log_path(node)}" and len(lines) == 8
    finally:
        client.close()
    assert _wait(lambda: agent_status(node)["attached"] == 0)
    st = agent_status(node)
    assert st["trainers"] == [] and 0 < st["exits_in_s"] <= 300 and st["idle_s"] >= 0
    rc, out, _err = _cli("agent", "--dir", str(node), "--status")
    assert "  trainers attached: 0\n" in out and ", exits in 4 min " in out
    # --stop: the agent exits, and nothing of it is left in shared memory; its log stays where status said
    rc, out, err = _cli("agent", "--dir", str(node), "--stop")
    assert (rc, out, err) == (0, f"stopped the agent of {node}\n", "")
    assert not os.path.exists(f"/proc/{pid}") or open(f"/proc/{pid}/stat").read().split(") ")[1][0] == "Z"
    assert not shm.exists(), sorted(str(p) for p in shm.rglob("*"))
    assert f"agent pid {pid} stopped; memory freed, {node} removed" in agent_log_path(node).read_text()
    # no agent: exit status 1 and one line, with or without --json
    for extra in ((), ("--json",)):
        rc, out, err = _cli("agent", "--dir", str(node), "--status", *extra)
        assert rc == 1 and out == "" and len(err.splitlines()) == 1
        assert err.startswith(f"lightning-snapshot agent: error: no agent directory {str(node)!r}: check --dir")
        assert err.rstrip().endswith("an agent that stopped removed it")
    node.mkdir(parents=True)
    rc, out, err = _cli("agent", "--dir", str(node), "--status", "--json")
    assert (
        rc == 1
        and out == ""
        and err
        == (
            f"lightning-snapshot agent: error: no agent serves {node} (none is"
            f" running for it); start one with: lightning-snapshot agent --dir"
            f" {node}\n"
        )
    )


# ------------------------------------------------------------------------------------------------ crash + restart
@pytest.mark.slow
def test_sigkilled_trainer_restores_from_ram_bitwise(tmp_path, shm, reference_runs):
    args = ("--max-steps", "12", "--every", "4", "--shuffle", "--dropout", "0.1")
    ref = reference_runs(*args)
    out = tmp_path / "out.pt"
    run_train(tmp_path / "local", out, *args, "--ram-every", "2", "--crash-at", "7", expect_kill=True)
    # the local tier has step 4, the RAM tier step 6: the newest comes from RAM
    assert committed_steps(LocalTier(tmp_path / "local"))[0] == 4
    proc = run_train(tmp_path / "local", out, *args, "--ram-every", "2")
    assert "RESTORED step=6 from=ram://test" in proc.stdout, proc.stdout + proc.stderr
    assert assert_bitwise_equal(ref, out) > 0


@pytest.mark.slow
def test_ddp_agents_commit_every_snapshot_while_each_file_stays_empty_for_a_while_after_it_is_created(
    tmp_path, shm, monkeypatch
):
    """The window of the agent-part race made wide on purpose: in every process (the trainers and the node's
    snapshot agent), the local tier pauses 0.3 s between creating a file and writing its bytes. Rank 0's agent polls
    for rank 1's manifest part all that time; it must never read it before it is whole. DDP on 2 ranks, the RAM tier
    and a local tier every step, nothing killed: every step is committed to the local tier, by the agent (with the
    replica check's outcome in its manifest)."""
    pauses = tmp_path / "pauses.log"
    monkeypatch.setenv(
        "PYTHONPATH",
        os.pathsep.join([str(Path(__file__).parent / "fixtures" / "pause_write"), os.environ.get("PYTHONPATH", "")]),
    )
    monkeypatch.setenv("LS_TEST_PAUSE_AFTER_CREATE", "0.3")
    monkeypatch.setenv("LS_TEST_PAUSE_LOG", str(pauses))
    steps = 10
    proc = run_train(
        tmp_path / "local",
        tmp_path / "out.pt",
        "--devices",
        "2",
        "--max-steps",
        str(steps),
        "--ram-every",
        "1",
        "--every",
        "1",
        "--keep-last",
        "0",
        timeout=240,
    )
    assert "failed" not in proc.stderr.lower(), proc.stderr[-3000:]
    assert committed_steps(LocalTier(tmp_path / "local")) == list(range(steps, 0, -1))
    # the replica check's outcome travels through the agent into the manifest it commits
    for step in range(1, steps + 1):
        rep = read_manifest(LocalTier(tmp_path / "local"), step).replicas
        assert rep is not None and rep.checked > 0 and rep.disagree_count == 0, (step, rep)
    # the window was open: the agent (not a trainer) paused on both ranks' parts of every step
    agent_pid = agent_status(next(shm.glob("*/agent.sock")).parent)["pid"]
    paused = [line.split() for line in pauses.read_text().splitlines()]
    for rank in (0, 1):
        named = [pid for pid, path in paused if f"-part-{rank:05d}.json" in path]
        assert len(named) == steps and set(named) == {str(agent_pid)}, (rank, paused[:10])


@pytest.mark.slow
@pytest.mark.parametrize("cuda_path", [False, True], ids=["cpu", "cuda-registration-noop"])
def test_agent_flushes_a_staged_snapshot_after_the_trainer_died(tmp_path, shm, reference_runs, monkeypatch, cuda_path):
    """cuda-registration-noop: the CUDA arena path (every slot registered for CUDA, here through the recording
    no-op of FAKE_REGISTER_ENV; the same code otherwise), so CI guards flush-after-death on GPUs without one."""
    record = tmp_path / "register.log"
    seen: list[str] = []

    def killed_run_registered(killed):
        seen.extend(record.read_text().splitlines() if record.exists() else [])
        monkeypatch.delenv(FAKE_REGISTER_ENV)
        assert "could not page-lock" not in killed.stderr

    check_flush_after_death(
        tmp_path,
        shm,
        reference_runs,
        monkeypatch,
        before_kill=(lambda: monkeypatch.setenv(FAKE_REGISTER_ENV, str(record))) if cuda_path else None,
        after_kill=killed_run_registered if cuda_path else None,
    )
    if cuda_path:
        # the killed trainer took the CUDA path: it registered its slots (for device 0), and, killed, never
        # unregistered them; the agent flushed from that very memory
        assert [line.split()[0] for line in seen].count("register") >= 1, seen
        assert all(line.split()[0] == "register" and line.split()[3] == "0" for line in seen), seen
    else:
        assert not record.exists()


@pytest.mark.slow
@pytest.mark.parametrize("how", ["SIGSTOP", "SIGKILL"])
def test_a_stuck_or_dead_agent_stops_training_with_an_error_naming_it(tmp_path, shm, how):
    """The node's agent stops answering (SIGSTOP: alive, connected, silent) or dies (SIGKILL) while it has snapshots
    to write: the trainer waits for a stuck one at most collective_timeout (5 s here), for a dead one not at all, and
    fit fails with AgentError naming the agent's pid and log (before, the persist thread waited forever for the
    answer, and training hung once every staging slot was held)."""
    import signal
    import time

    env = {
        **os.environ,
        "PYTHONWARNINGS": "ignore::DeprecationWarning",
        "LIGHTNING_SNAPSHOT_AGENT_WRITE_DELAY": "3",
    }  # (the agent has a snapshot to write when it is stopped)
    proc = subprocess.Popen(
        [
            sys.executable,
            str(SCRIPTS / "train.py"),
            "--dir",
            str(tmp_path / "local"),
            "--out",
            str(tmp_path / "out.pt"),
            "--max-steps",
            "400",
            "--every",
            "4",
            "--ram-every",
            "2",
            "--collective-timeout",
            "5",
        ],
        env=env,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    pid = None
    try:
        assert _wait(
            lambda: any(
                "attached" in agent_log_path(p.parent).read_text()
                for p in shm.glob("**/agent.lock")
                if agent_log_path(p.parent).exists()
            ),
            timeout=120,
        ), "the trainer never attached to its agent"
        # the agent committed a first snapshot; 1.5 s later it is in the 3 s it waits before writing the next one
        assert _wait(lambda: committed_steps(LocalTier(tmp_path / "local")), timeout=120)
        time.sleep(1.5)
        lock = next(shm.glob("**/agent.lock"))
        pid = int(lock.read_text().splitlines()[0])
        os.kill(pid, getattr(signal, how))
        _out, err = proc.communicate(timeout=180)  # (hung before: the persist thread waited for it forever)
    finally:
        if proc.poll() is None:
            proc.kill()
        if pid is not None and os.path.exists(f"/proc/{pid}"):
            os.kill(pid, signal.SIGKILL)
    assert proc.returncode == 1, err[-3000:]
    assert "AgentError" in err and f"snapshot agent (pid {pid}) of {lock.parent}" in err, err[-3000:]
    assert f"(its log: {agent_log_path(lock.parent)})" in err, err[-3000:]
    assert (
        "sent nothing for 5 s: it is stopped or hung"
        if how == "SIGSTOP"
        else "closed the connection (it exited or was killed)"
    ) in err, err[-3000:]


# ------------------------------------------------------------------------------------------------ erasure
def _nodes(script_args, nodes, base):
    procs = launch_nodes("ram_nodes.py", nodes, *script_args, "--base", str(base))
    for p in procs:
        assert p.returncode == 0, p.stdout + p.stderr
    return procs


def _check_loaded(out: Path, nodes: int, mb: float) -> None:
    import ram_nodes

    expected = ram_nodes.state(0, mb)["weights"]
    for r in range(nodes):
        got = torch.load(f"{out}.rank{r}", weights_only=True)
        for name, t in expected.items():
            assert torch.equal(got["shared"][name].view(torch.uint8), t.view(torch.uint8)), f"rank {r}: {name}"
        assert torch.equal(got["rank"], torch.arange(4) + r)


def _share_bytes(base: Path) -> int:
    return sum(p.stat().st_size for p in base.glob("node*/run/store/*/*.ec/[0-9]*"))


@pytest.mark.slow
def test_erasure_2_plus_1_survives_every_single_node_loss_and_repairs_a_flipped_byte(tmp_path):
    saved = tmp_path / "saved"
    mb = 3.0
    _nodes(["save", "--erasure", "2+1", "--mb", str(mb)], 3, saved)
    # memory: (k + m) / k = 1.5 x the state, measured on the share files of all nodes
    data = sum(
        o.nbytes
        for o in __import__("lightning_snapshot.restore.loader", fromlist=["x"])
        .read_manifest(
            __import__("lightning_snapshot.backends.local", fromlist=["x"]).LocalTier(
                saved / "node0" / "run" / "store"
            ),
            10,
        )
        .objects
    )
    assert _share_bytes(saved) <= 1.5 * data + 64 * 2 * 3 * 8, (_share_bytes(saved), data)
    for lost in range(3):
        base = tmp_path / f"lost{lost}"
        shutil.copytree(saved, base)
        shutil.rmtree(base / f"node{lost}")
        procs = _nodes(["load", "--erasure", "2+1", "--out", str(base / "out")], 3, base)
        assert all("LOADED" in p.stdout for p in procs), [p.stdout for p in procs]
        _check_loaded(base / "out", 3, mb)
    # a flipped byte in a share is detected, treated as missing and rebuilt from the others
    base = tmp_path / "flipped"
    shutil.copytree(saved, base)
    share = next((base / "node1" / "run" / "store").glob("step-*/run0-shared-00000.bin.ec/1"))
    raw = bytearray(share.read_bytes())
    raw[1234] ^= 0x40
    share.write_bytes(bytes(raw))
    procs = _nodes(["load", "--erasure", "2+1", "--out", str(base / "out")], 3, base)
    assert "checksum mismatch" in procs[1].stderr, procs[1].stderr
    _check_loaded(base / "out", 3, mb)
    # m + 1 = 2 lost nodes: not restorable, and the error says why
    base = tmp_path / "two_lost"
    shutil.copytree(saved, base)
    shutil.rmtree(base / "node0")
    shutil.rmtree(base / "node2")
    procs = _nodes(["load", "--erasure", "2+1", "--out", str(base / "out")], 3, base)
    assert all("FAILED" in p.stdout and "good share(s) of the 2 needed" in p.stdout for p in procs), procs[0].stdout


@pytest.mark.slow
def test_erasure_4_plus_2_survives_a_sample_of_double_node_losses(tmp_path):
    """6 nodes, erasure 4+2: any 2 lost nodes are survivable. A sample of 2 of the 15 pairs (each pair costs a
    6-process load): the first and last node, and two neighbours in the middle."""
    saved = tmp_path / "saved"
    _nodes(["save", "--erasure", "4+2", "--mb", "1"], 6, saved)
    for lost in [(0, 5), (2, 3)]:
        base = tmp_path / f"lost{lost[0]}{lost[1]}"
        shutil.copytree(saved, base)
        for n in lost:
            shutil.rmtree(base / f"node{n}")
        procs = _nodes(["load", "--erasure", "4+2", "--out", str(base / "out")], 6, base)
        assert all("LOADED" in p.stdout for p in procs), [p.stdout + p.stderr[-500:] for p in procs]
        _check_loaded(base / "out", 6, 1.0)


@pytest.mark.slow
def test_too_many_lost_shares_fall_back_to_the_local_tier_with_one_log_line(tmp_path, reference_runs):
    """Two simulated nodes with erasure 1+1: node 0's memory lost and node 1's shares corrupted -> local tier."""
    args = ("--max-steps", "12", "--every", "3", "--shuffle")
    base = tmp_path / "shm"
    env = {"LIGHTNING_SNAPSHOT_SHM_DIR": str(base) + "/node{node}"}
    common = (
        "--dir",
        str(tmp_path / "local"),
        "--out",
        str(tmp_path / "out.pt"),
        *args,
        "--num-nodes",
        "2",
        "--ram-every",
        "2",
        "--ram-erasure",
        "1+1",
    )
    try:
        procs = launch_nodes("train.py", 2, *common, "--crash-at", "8", env=env)
        assert [p.returncode for p in procs] == [-9, -9], [p.stderr[-2000:] for p in procs]
        assert committed_steps(LocalTier(tmp_path / "local"))[0] == 6
        stop_agent(base / "node0" / "test")  # node 0's memory is lost: the agent frees it and leaves nothing
        assert not (base / "node0").exists(), sorted(str(p) for p in (base / "node0").rglob("*"))
        for share in (base / "node1" / "test" / "store").glob("step-*/*.ec/[0-9]*"):
            raw = bytearray(share.read_bytes())
            raw[0] ^= 1
            share.write_bytes(bytes(raw))
        procs = launch_nodes("train.py", 2, *common, env=env)
        assert [p.returncode for p in procs] == [0, 0], [p.stderr[-3000:] for p in procs]
        log = procs[0].stderr
        assert "cannot restore the snapshot of step 8 in the ram tier" in log and "good share(s)" in log, (
            procs[0].stdout + log[-3000:]
        )
        assert "RESTORED step=6 from=" + str(tmp_path / "local") in procs[0].stdout
    finally:
        for sock in list(base.glob("**/agent.sock")):  # (listed first: a stopped agent removes its directory)
            stop_agent(sock.parent)
    ref = tmp_path / "ref"
    procs = launch_nodes(
        "train.py", 2, "--dir", str(ref / "local"), "--out", str(ref / "out.pt"), *args, "--num-nodes", "2", env=env
    )
    assert [p.returncode for p in procs] == [0, 0]
    for suffix in ("", ".rank1"):
        assert_bitwise_equal(Path(f"{ref / 'out.pt'}{suffix}"), Path(f"{tmp_path / 'out.pt'}{suffix}"))


assert SCRIPTS.is_dir()


@pytest.mark.slow
def test_agent_flushes_a_snapshot_handed_over_before_its_checksums_were_taken(tmp_path, shm):
    """On CUDA the agent is told a snapshot is staged as soon as its bytes are in the arena, before the hash threads
    are done (then it survives the trainer sooner). A trainer that dies right after that message: the agent writes
    the snapshot on its own, with checksums it takes itself, and it loads, verified, with the staged values."""
    from agent_handoff import STEP, expected_state

    from lightning_snapshot import load_snapshot

    node, local = shm / "handoff", tmp_path / "local"
    proc = subprocess.run(
        [sys.executable, str(SCRIPTS / "agent_handoff.py"), "--node-dir", str(node), "--local", str(local)],
        capture_output=True,
        text=True,
        timeout=120,
        start_new_session=True,
    )
    assert proc.returncode == -9 and "STAGED" in proc.stdout, proc.stderr[-3000:]
    assert _wait(lambda: STEP in committed_steps(LocalTier(local)), timeout=60), agent_log_path(node).read_text()
    assert f"step {STEP} committed to tier 0 after rank 0 died" in agent_log_path(node).read_text()
    got = load_snapshot(str(local), step=STEP)  # every chunk verified against the checksums the agent wrote
    want = expected_state()
    for name, t in want["state_dict"].items():
        assert got["state_dict"][name].dtype == t.dtype and torch.equal(got["state_dict"][name], t), name
    exp_avg = want["optimizer_states"][0]["state"][0]["exp_avg"]
    assert torch.equal(got["optimizer_states"][0]["state"][0]["exp_avg"], exp_avg)
    assert stop_agent(node)


def test_under_ddp_one_rank_losing_its_agent_link_keeps_the_durable_snapshots_committing(tmp_path, shm):
    """A RAM tier whose agents write the local tier, two ranks; at step 5 rank 1 alone loses the link to its agent.
    The ranks agree at each hand-over whether the agents write: from step 8 on every rank writes the local tier
    itself, and steps 8 and 12 are committed by the trainers (rank 1 used to write it itself while rank 0's agent
    waited for rank 1's part: both failed, and no later snapshot of the fit reached the local tier)."""
    snaps = tmp_path / "snaps"
    proc = run_script("agent_lost_one_rank.py", "--dir", str(snaps), timeout=240)
    assert "rank 0: FIT RETURNED step=12" in proc.stdout and "rank 1: FIT RETURNED step=12" in proc.stdout
    assert "rank 1 lost the link to its snapshot agent" in proc.stderr
    assert "failed; training goes on" not in proc.stderr and "not durable" not in proc.stderr
    assert committed_steps(LocalTier(str(snaps))) == [12, 8, 4]
