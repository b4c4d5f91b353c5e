"""The RAM tier's agent behind a declared Backend interface: the engine knows ``NodeAgentHosting``, ``NodeAgent`` and
the typed ``AgentJob``, never the concrete agent, the RAM tier's class or a tier's name."""

from __future__ import annotations

import ast
import threading
from pathlib import Path

import pytest
import torch

from lightning_snapshot import SnapshotCallback
from lightning_snapshot.backends import LocalTier, ObjectStoreTier, RamTier
from lightning_snapshot.backends.base import Backend, NodeAgentHosting
from lightning_snapshot.errors import ConfigError
from lightning_snapshot.persist.threads import PersistJob
from lightning_snapshot.staging import stage
from lightning_snapshot.staging.arena import HostArena

ROOT = Path(__file__).resolve().parents[2]
#: the engine's modules that wire and drive the tiers
ENGINE = (
    "config.py",
    "fit/session.py",
    "persist/threads.py",
    "fit/pipeline.py",
    "persist/writer.py",
    "restore/restorer.py",
    "fit/reporting.py",
)


def test_tiers_declare_whether_they_host_a_node_agent(tmp_path):
    assert isinstance(RamTier(name="t"), NodeAgentHosting)
    assert not isinstance(LocalTier(tmp_path), NodeAgentHosting)
    assert not isinstance(ObjectStoreTier("memory://bucket/run"), NodeAgentHosting)
    assert LocalTier.copy_source and not RamTier.copy_source and not ObjectStoreTier.copy_source
    with pytest.raises(ConfigError, match="at most one RAM tier"):
        SnapshotCallback([RamTier(name="a"), RamTier(name="b")])


def test_the_engine_names_no_concrete_agent_nor_tier():
    """No import of the RAM tier's modules, no check of a tier's name, in the engine."""
    for name in ENGINE:
        tree = ast.parse((ROOT / "lightning_snapshot" / name).read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                assert not (node.module or "").startswith("lightning_snapshot.backends.ram"), (name, node.module)
            if isinstance(node, ast.Compare) and isinstance(node.left, ast.Attribute) and node.left.attr == "tier":
                assert not any(isinstance(c, ast.Constant) and isinstance(c.value, str) for c in node.comparators), (
                    f"{name}:{node.lineno} checks a tier's name"
                )


def test_the_agent_client_reads_a_job_through_its_protocol_only():
    """AgentClient reads the job through AgentJob's typed members, never probes it with getattr."""
    source = (ROOT / "backends" / "ram" / "agent_client.py").read_text()
    calls = [
        n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.Call) and getattr(n.func, "id", None) == "getattr"
    ]
    assert all(not (isinstance(c.args[0], ast.Attribute | ast.Name) and "job" in ast.unparse(c.args[0])) for c in calls)


def test_a_persist_job_is_an_agent_job(tmp_path):
    """What the agent reads of the engine's job: the slot the shared state is staged in and its layout."""
    local = LocalTier(tmp_path)
    private = stage({"rng": torch.get_rng_state()}, "rank")
    plain = PersistJob(3, 0, stage({"w": torch.ones(4)}, "shared"), private, [local])
    assert plain.slot is None and plain.shared_state is plain.shared and plain.replicas is None
    arena = HostArena(chunk_bytes=1 << 16)
    try:
        handle = arena.stage_async({"w": torch.ones(4)}, lambda t: True, 3)
        assert handle is not None
        handle.wait()
        job = PersistJob(3, 0, handle, private, [local])
        assert job.slot is handle.slot and job.slot.capacity > 0 and job.shared_state is handle.state
    finally:
        arena.close()


class _Host(ObjectStoreTier):
    """A tier hosting a fake node agent (held in memory, as the RAM tier): what the session does with it, through the
    interface alone."""

    durable = False
    node_leader = True  # (this rank starts the node's agent)

    def __init__(self, url) -> None:
        super().__init__(url)
        self.calls: list[str] = []

    def propose_name(self, others):
        self.calls.append("propose_name")
        return "fake"

    def bind(self, *, node_rank, num_nodes, local_rank, ranks_per_node, default_name):
        self.calls.append(f"bind {default_name}")

    def start_agent(self):
        self.calls.append("start_agent")

    def connect_agent(self, *, rank, world_size, run_id, tiers, part_wait):
        self.calls.append(f"connect_agent {[t.url for t in tiers]}")
        return _Agent()


class _Agent:
    linked = True

    def handles(self, job, tier):
        return False

    def persist(self, job, tier, stop: threading.Event):
        raise AssertionError("not handled")

    def staged(self, job):
        pass

    def release(self, slot, ok):
        pass

    def close(self):
        pass


def test_the_session_sets_up_any_tier_that_hosts_a_node_agent(tmp_path):
    from types import SimpleNamespace

    from lightning_snapshot.config import SnapshotConfig
    from lightning_snapshot.fit.session import FitSession

    host = _Host("memory://host/run")
    assert isinstance(host, NodeAgentHosting) and isinstance(host, Backend)
    durable = LocalTier(tmp_path / "durable")
    config = SnapshotConfig.create([host, durable])
    strategy = SimpleNamespace(world_size=1, node_rank=0, local_rank=0)
    session = FitSession.open(config, SimpleNamespace(strategy=strategy, num_nodes=1))
    try:
        assert host.calls == ["propose_name", "bind fake", "start_agent", f"connect_agent {[durable.url]}"]
        assert isinstance(session.agent, _Agent) and session.persister.agent is session.agent
    finally:
        session.close(abort=False)
