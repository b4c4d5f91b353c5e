"""The per-node snapshot agent: a process that outlives the trainer and owns the node's RAM-tier memory.

- :mod:`.server`: the agent process (run by ``lightning-snapshot agent``, which calls :func:`run_agent`);
- :mod:`.writes`: what it writes: a staged snapshot to a durable tier under the commit rule, a flush after the
  trainers died, a step kept in the node's RAM store.

The RAM tier is its client: the trainer's side (:func:`ensure_agent`, :class:`AgentClient`, status and stop) and the
protocol both sides speak live with the tier, in :mod:`lightning_snapshot.backends.ram.agent_client` and
:mod:`lightning_snapshot.backends.ram.agent_protocol`. This package re-exports the names the CLI and the tests use.

May import: persist (the writer's public functions and the commit rule), backends, staging, format, dist, errors.
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
