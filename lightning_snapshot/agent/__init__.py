"""The per-node snapshot agent: a process that outlives the trainer and owns the node's RAM-tier memory.

- :mod:`.protocol`: the wire format, the lock file and the constants both sides share;
- :mod:`.server`: the agent process (run by ``lightning-snapshot agent``, which calls :func:`run_agent`);
- :mod:`.client`: the trainer's side (:func:`ensure_agent`, :class:`AgentClient`, status and stop).

This package re-exports the names the rest of the library, the CLI and the tests use.
"""

from __future__ import annotations

from lightning_snapshot.agent.server import Agent, run_agent
from lightning_snapshot.backends.ram.agent_client import (
    AgentClient,
    agent_status,
    ensure_agent,
    format_status,
    stop_agent,
)
from lightning_snapshot.backends.ram.agent_protocol import (
    HEARTBEAT_S,
    LOCK,
    PART_WAIT_S,
    SILENCE_S,
    SOCK,
    STATUS_VERSION,
    agent_log_path,
    describe_staged,
    rebuild_staged,
)

__all__ = [
    "HEARTBEAT_S",
    "LOCK",
    "PART_WAIT_S",
    "SILENCE_S",
    "SOCK",
    "STATUS_VERSION",
    "Agent",
    "AgentClient",
    "agent_log_path",
    "agent_status",
    "describe_staged",
    "ensure_agent",
    "format_status",
    "rebuild_staged",
    "run_agent",
    "stop_agent",
]
