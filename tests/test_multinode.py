"""Multi-node jobs (3 simulated nodes, real processes, gloo, real SIGKILL): a local tier on each node's own disk or
shared by all nodes, beside an erasure-coded RAM tier; a replaced node; a rank that fails mid-snapshot."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from conftest import assert_bitwise_equal, launch_nodes

from lightning_snapshot.agent import stop_agent
from lightning_snapshot.backends import LocalTier
from lightning_snapshot.format.manifest import MANIFEST_NAME, step_dirname
from lightning_snapshot.persist.writer import committed_steps

# the module-scoped fixtures below are shared by this file's tests: under pytest-xdist they run in one worker
pytestmark = pytest.mark.xdist_group("test_multinode")

NODES = 3
# RAM every 4 steps (erasure 2+1 over the 3 nodes), the local tier every 3; killed at step 10: RAM holds 8, local 9
ARGS = (
    "--max-steps",
    "12",
    "--every",
    "3",
    "--shuffle",
    "--num-nodes",
    str(NODES),
    "--ram-every",
    "4",
    "--ram-erasure",
    "2+1",
)
# the directory: each node's own through the {node_rank} placeholder, each node's own through an environment
# variable that differs per node (the same-looking path on every node: detected with probe files), or one shared
LAYOUTS = {"node-local": "local/node{node_rank}", "node-local-env": "$NODE_DISK", "shared": "local"}


def _env(base: Path) -> dict[str, str]:
    return {
        "LIGHTNING_SNAPSHOT_SHM_DIR": str(base / "shm") + "/node{node}",
        "NODE_DISK": str(base / "local") + "/node{node}",
    }


def _stop_agents(base: Path) -> None:
    for sock in list((base / "shm").glob("**/agent.sock")):  # (a stopped agent removes its directory)
        stop_agent(sock.parent)


def _run(base: Path, layout: str, *extra: str, timeout: int = 600):
    where = LAYOUTS[layout] if LAYOUTS[layout].startswith("$") else str(base / LAYOUTS[layout])
    return launch_nodes(
        "train.py", NODES, "--dir", where, "--out", str(base / "out.pt"), *ARGS, *extra, env=_env(base), timeout=timeout
    )


def _tails(procs) -> str:
    """Every node's exit status and the end of its output, as one message (pytest shortens a list's repr)."""
    return "\n".join(
        f"--- node {i}: rc={p.returncode}\n{p.stdout[-1000:]}\n{p.stderr[-4000:]}" for i, p in enumerate(procs)
    )


def _ok(procs) -> None:
    assert [p.returncode for p in procs] == [0] * NODES, _tails(procs)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """One uninterrupted 3-node run (its RAM and local tiers are this run's own)."""
    base = tmp_path_factory.mktemp("ref")
    try:
        _ok(_run(base, "node-local"))
    finally:
        _stop_agents(base)
    return base / "out.pt"


def _same_as_reference(reference: Path, base: Path) -> None:
    for suffix in ("", ".rank1", ".rank2"):
        assert assert_bitwise_equal(Path(f"{reference}{suffix}"), Path(f"{base / 'out.pt'}{suffix}")) > 0


def _local(base: Path, layout: str, node: int) -> LocalTier:
    return LocalTier(base / "local" if layout == "shared" else base / "local" / f"node{node}")


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["node-local", "shared"])
def test_sigkill_all_trainers_and_resume_bitwise(tmp_path, reference, layout):
    try:
        procs = _run(tmp_path, layout, "--crash-at", "10")
        assert [p.returncode for p in procs] == [-9] * NODES, _tails(procs)
        said = "is node-local" if layout == "node-local" else "is shared by all nodes (detected)"
        assert said in procs[0].stdout + procs[0].stderr, procs[0].stderr[-3000:]
        prefix = step_dirname(9)
        for node in range(NODES):
            tier = _local(tmp_path, layout, node)
            assert committed_steps(tier)[0] == 9
            objects = [n for n in tier.list(prefix) if n.endswith(".bin")]
            if layout == "node-local":  # its own rank's objects, and a copy of the manifest
                assert objects and all(n.endswith(f"-{node:05d}.bin") for n in objects), objects
                assert tier.exists(f"{prefix}/{MANIFEST_NAME}")
            else:
                assert {n[-9:-4] for n in objects} == {f"{r:05d}" for r in range(NODES)}, objects
        procs = _run(tmp_path, layout)
        _ok(procs)
        assert all(
            f"RESTORED step=9 from={_local(tmp_path, layout, n).url}" in procs[n].stdout for n in range(NODES)
        ), [p.stdout for p in procs]
    finally:
        _stop_agents(tmp_path)
    _same_as_reference(reference, tmp_path)


@pytest.mark.slow
def test_replaced_node_falls_back_to_the_ram_tier_naming_the_node_and_step(tmp_path, reference):
    try:
        procs = _run(tmp_path, "node-local-env", "--crash-at", "10")
        assert [p.returncode for p in procs] == [-9] * NODES, _tails(procs)
        assert "is node-local" in procs[0].stderr and "(detected)" in procs[0].stderr, procs[0].stderr[-3000:]
        # node 1 is replaced: its memory (agent and files) and its disk are empty
        stop_agent(tmp_path / "shm" / "node1" / "test")  # (the stopped agent leaves nothing in node 1's memory)
        assert not (tmp_path / "shm" / "node1").exists(), sorted(str(p) for p in (tmp_path / "shm").rglob("*"))
        shutil.rmtree(tmp_path / "local" / "node1")
        procs = _run(tmp_path, "node-local-env")
        _ok(procs)
        log = procs[0].stderr
        assert "cannot restore the snapshot of step 9 in the local tier" in log, log[-3000:]
        assert "node(s) 1 of this job do not hold step 9" in log, log[-3000:]
        # the RAM tier's 2+1 erasure code survives the loss of one node: its step 8 is the newest left
        assert all("RESTORED step=8 from=ram://test" in p.stdout for p in procs), [p.stdout for p in procs]
    finally:
        _stop_agents(tmp_path)
    _same_as_reference(reference, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["node-local", "shared"])
def test_a_rank_that_raises_mid_snapshot_ends_every_process_non_zero(tmp_path, layout, monkeypatch):
    # every local-tier write is slow (the trainer's for a node-local tier, the agent's for a shared one), and rank 1
    # raises at step 7 while the snapshot of step 6 is being written: no process may hang (the bound is
    # shutdown_timeout + the time a dead peer takes to break a collective; the test's own timeout is generous)
    monkeypatch.setenv("LIGHTNING_SNAPSHOT_AGENT_WRITE_DELAY", "2")
    try:
        procs = _run(tmp_path, layout, "--slow-write", "2", "--raise-at", "7", "--raise-rank", "1", timeout=400)
    finally:
        _stop_agents(tmp_path)
    assert "RAISING rank=1 step=7" in procs[1].stdout, procs[1].stderr[-3000:]
    assert all(p.returncode != 0 for p in procs), [(p.returncode, p.stderr[-2000:]) for p in procs]
    assert "RuntimeError: injected failure on rank 1 at step 7" in procs[1].stderr, procs[1].stderr[-3000:]


# ------------------------------------------------------------------------------------------------ without Lightning
def _nodes(mode: str, nodes: int, base: Path, *extra: str):
    return launch_nodes("ram_nodes.py", nodes, mode, "--base", str(base), "--mb", "0.5", *extra, timeout=300)


@pytest.mark.slow
def test_node_local_tier_restores_on_more_nodes_by_fetching_over_gloo_and_names_a_lost_node(tmp_path):
    import ram_nodes
    import torch

    procs = _nodes("local-save", 2, tmp_path)
    assert [p.returncode for p in procs] == [0, 0], [p.stderr[-3000:] for p in procs]
    prefix = step_dirname(10)
    for node in range(2):  # each node: its own rank's objects and a copy of the manifest
        names = LocalTier(tmp_path / f"disk{node}").list(prefix)
        assert MANIFEST_NAME in names and all(n.endswith(f"-{node:05d}.bin") for n in names if n.endswith(".bin"))
    # 3 nodes now: node 2's disk is empty; every node gets the objects it lacks from the others, over gloo
    procs = _nodes("local-load", 3, tmp_path, "--out", str(tmp_path / "out"))
    assert [p.returncode for p in procs] == [0] * 3 and all("LOADED" in p.stdout for p in procs), [
        p.stdout + p.stderr[-2000:] for p in procs
    ]
    expected = ram_nodes.state(0, 0.5)["weights"]
    for r in range(3):
        got = torch.load(f"{tmp_path / 'out'}.rank{r}", weights_only=True)
        assert got["shared"].keys() == expected.keys()
        for name, t in expected.items():
            assert torch.equal(got["shared"][name].view(torch.uint8), t.view(torch.uint8)), (r, name)
        assert torch.equal(got["rank"], torch.arange(4))  # (another world size: rank 0's section)
    # what was fetched for the restore is gone again: each node holds what it wrote
    assert not LocalTier(tmp_path / "disk2").list(prefix)
    assert all(n.endswith("-00000.bin") for n in LocalTier(tmp_path / "disk0").list(prefix) if n.endswith(".bin"))
    # node 1 replaced by one with an empty disk: its rank's data is on no node
    shutil.rmtree(tmp_path / "disk1")
    procs = _nodes("local-load", 2, tmp_path, "--out", str(tmp_path / "out2"))
    assert all(
        "FAILED: node(s) 1 of this job do not hold step 10 of the node-local tier" in p.stdout
        and "the data of rank(s) 1 is on no node" in p.stdout
        for p in procs
    ), [p.stdout for p in procs]


@pytest.mark.slow
@pytest.mark.parametrize("broken", ["listing", "manifest", "storing"])
def test_a_node_whose_disk_fails_in_a_node_local_restore_fails_every_rank_at_once_naming_it(tmp_path, broken):
    """The node leaders' inventories and the manifest holder's read go through the ranks' agreement: a disk error on
    one node is every rank's error, naming that rank, at once (the group's timeout is 30 min: a rank left waiting
    would run into the test's timeout instead)."""
    procs = _nodes("local-save", 2, tmp_path)
    assert [p.returncode for p in procs] == [0, 0], [p.stderr[-3000:] for p in procs]
    prefix = step_dirname(10)
    if broken == "listing":  # node 1: an object that cannot be stat'ed (a link to a file that is gone)
        victim = next(n for n in LocalTier(tmp_path / "disk1").list(prefix) if n.endswith(".bin"))
        path = tmp_path / "disk1" / prefix / victim
        path.unlink()
        path.symlink_to("gone.bin")
        expected = f"rank 1 (node 1) cannot list step 10 of the node-local tier {tmp_path / 'disk1'}"
    elif broken == "manifest":  # node 0 (the first node holding the manifest): its manifest's bytes are garbage
        (tmp_path / "disk0" / prefix / MANIFEST_NAME).write_bytes(b"\xff\xfe" * 64)
        expected = f"rank 0 (node 0) cannot read the manifest of step 10 of the node-local tier {tmp_path / 'disk0'}"
    else:  # node 0 lacks the manifest and cannot store the copy it fetches (a directory in its place)
        path = tmp_path / "disk0" / prefix / MANIFEST_NAME
        path.unlink()
        path.mkdir()
        expected = f"rank 0 (node 0) cannot store what it fetched of step 10 of the node-local tier {tmp_path / 'disk0'}"
    procs = launch_nodes(
        "ram_nodes.py", 2, "local-load", "--base", str(tmp_path), "--out", str(tmp_path / "out"), timeout=120
    )
    for rank, p in enumerate(procs):
        assert "FAILED: " in p.stdout and expected in p.stdout, (rank, p.stdout, p.stderr[-2000:])
        culprit = 1 if broken == "listing" else 0
        if rank != culprit:  # the other rank says where it failed
            assert f"on rank {culprit}" in p.stdout, p.stdout


@pytest.mark.slow
def test_a_rank_that_dies_mid_write_fails_the_others_at_once_naming_rank_tier_and_wait(tmp_path):
    procs = _nodes("local-die", 3, tmp_path)
    assert procs[2].returncode == 3
    for r in (0, 1):
        assert procs[r].returncode == 1, procs[r].stdout + procs[r].stderr[-3000:]
        assert (
            f"WRITE FAILED: rank {r}: waiting for the other ranks to agree on writing the data of the snapshot of"
            f" step 10 in the local tier {tmp_path / f'disk{r}'} failed"
        ) in procs[r].stdout, procs[r].stdout
        assert committed_steps(LocalTier(tmp_path / f"disk{r}")) == []


# ------------------------------------------------------------------------------------------------ in one process
class _StuckDisk(LocalTier):
    """A real local tier on a disk that stops answering (every data write blocks until ``release`` is set)."""

    def __init__(self, path, **kw) -> None:
        super().__init__(path, **kw)
        import threading

        self.release, self.writing = threading.Event(), threading.Event()

    def write(self, key, buffers):
        self.writing.set()
        self.release.wait(120)
        return super().write(key, buffers)


def test_shutdown_after_an_exception_waits_at_most_shutdown_timeout_and_names_rank_tier_step(tmp_path, caplog):
    import torch

    from lightning_snapshot.dist.comm import LocalComm
    from lightning_snapshot.persist.threads import Persister, PersistJob
    from lightning_snapshot.staging import stage
    from lightning_snapshot.staging.arena import HostArena

    tier = _StuckDisk(tmp_path / "stuck")
    arena = HostArena()
    persister = Persister([tier], [LocalComm()], "run0", arena)
    try:
        for step in (3, 6):  # one being written, one queued
            job = PersistJob(step, 0, stage({"w": torch.ones(4)}, "shared"), stage({"r": 1}, "rank"), [tier])
            persister.submit(job, [0])
        assert tier.writing.wait(60)
        late = persister.close(timeout=0.5, abort=True)
        assert late == [
            f"rank 0: the persist thread of the local tier {tier.url} did not finish step 3 within"
            " shutdown_timeout=0.5 s (waiting for the other ranks or the store); left behind"
        ]
        assert late[0] in caplog.text
    finally:
        tier.release.set()
        for w in persister._workers:
            w.thread.join(60)
        arena.close()
    assert committed_steps(tier) == [3]  # the write in progress finished on its own; the queued one was dropped


def test_node_local_option_url_and_placeholder(tmp_path, monkeypatch):
    from lightning_snapshot.backends.registry import parse_tier
    from lightning_snapshot.errors import ConfigError

    monkeypatch.setenv("NODE_RANK", "2")
    tier = parse_tier(f"{tmp_path}/disk{{node_rank}}/run?every=5&node_local=auto")
    assert tier.root == tmp_path / "disk2" / "run" and tier.node_local_option is None
    tier.bind(node_rank=1, num_nodes=3, local_rank=0, ranks_per_node=1)
    assert tier.root == tmp_path / "disk1" / "run"
    assert tier.settle_layout(None, "x") == "{node_rank} in the path" and tier.node_local and tier.node_leader
    assert parse_tier(f"{tmp_path}/s?node_local=true").node_local_option is True
    assert parse_tier(f"{tmp_path}/s?node_local=false").node_local_option is False
    with pytest.raises(ConfigError, match="node_local='maybe' must be auto, true or false"):
        parse_tier(f"{tmp_path}/s?node_local=maybe")
    with pytest.raises(ConfigError, match="cannot be node_local=False"):
        LocalTier(tmp_path / "disk{node_rank}", node_local=False)
    with pytest.raises(ConfigError, match="node_local must be True, False or None"):
        LocalTier(tmp_path, node_local="yes")
    one = LocalTier(tmp_path / "one")
    one.bind(node_rank=0, num_nodes=1, local_rank=0, ranks_per_node=2)
    assert one.settle_layout(None, "x") == "one node" and not one.node_local and not one.node_leader
