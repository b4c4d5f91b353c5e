"""The RAM tier's place in the job: its options of place (erasure ``(k, m)``, the run's name, the memory's base
directory, the agent's idle time, threads), this rank's node (:meth:`RamPlacement.bind`), where the node keeps the
run's memory and its store (a :class:`~lightning_snapshot.backends.ram.node_store.NodeStore`), which node holds which
share (``(n + i) % num_nodes``), and the node's snapshot agent it hosts
(:class:`~lightning_snapshot.backends.base.NodeAgentHosting`: start it, link this rank to it).

:class:`RamPlacement` is a part that :class:`~lightning_snapshot.backends.ram.tier.RamTier` holds (its
``placement``); the tier's other parts (:mod:`~lightning_snapshot.backends.ram.store`,
:mod:`~lightning_snapshot.backends.ram.distribution`, :mod:`~lightning_snapshot.backends.ram.restoring`) reach the
node's store through it.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lightning_snapshot.backends.base import Backend, NodeAgent
from lightning_snapshot.backends.ram import erasure as _ec
from lightning_snapshot.backends.ram.node import allocated_bytes, default_run_name, default_shm_base
from lightning_snapshot.backends.ram.node_store import NodeStore, node_store
from lightning_snapshot.errors import ConfigError

__all__ = ["RamPlacement", "parse_erasure"]

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


def parse_erasure(value: Any) -> tuple[int, int] | None:
    """``None``, ``(k, m)`` or ``"k+m"`` -> ``(k, m)`` or None."""
    if value is None or value in ("none", "None", ""):
        return None
    if isinstance(value, str):
        m = re.fullmatch(r"\s*(\d+)\s*[+\s]\s*(\d+)\s*", value)  # (a URL query reads + as a space)
        if not m:
            raise ConfigError(f"erasure={value!r}: write it as k+m, e.g. 4+2 (4 data and 2 parity shares), or none")
        value = (int(m.group(1)), int(m.group(2)))
    if not isinstance(value, (tuple, list)) or len(value) != 2:
        raise ConfigError(f"erasure must be None or a (k, m) pair such as (4, 2), got {value!r}")
    return _ec.check_params(value[0], value[1])


class RamPlacement:
    """Where this rank is, its node's memory directory and store, and the node's agent.

    Args: ``erasure``, ``name``, ``shm_dir``, ``idle_timeout``, ``threads``: see
    :class:`~lightning_snapshot.backends.ram.tier.RamTier` (validated here).
    """

    def __init__(
        self,
        erasure: tuple[int, int] | str | None,
        name: str | None,
        shm_dir: str | None,
        idle_timeout: float,
        threads: int | None,
    ) -> None:
        #: ``(k, m)``, or None (a node-local copy of each rank's data)
        self.erasure = parse_erasure(erasure)
        if name is not None and (not isinstance(name, str) or not _NAME.match(name)):
            raise ConfigError(f"RamTier name must be 1-128 letters, digits, '.', '_' or '-', got {name!r}")
        if isinstance(idle_timeout, bool) or not isinstance(idle_timeout, (int, float)) or idle_timeout <= 0:
            raise ConfigError(f"idle_timeout must be a positive number of seconds, got {idle_timeout!r}")
        if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or threads < 1):
            raise ConfigError(f"threads must be an integer >= 1 or None, got {threads!r}")
        #: the run's name (None until :meth:`bind` gives the default)
        self.name = name
        self.shm_base = shm_dir
        self.idle_timeout = float(idle_timeout)
        self.threads = threads
        # topology (bind): single node until the callback says otherwise
        self.node_rank, self.num_nodes, self.local_rank, self.ranks_per_node = 0, 1, 0, 1
        self._store: NodeStore | None = None

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_store"] = None  # (opened again in the process that uses it)
        return state

    # ------------------------------------------------------------------------------------------- set-up
    def bind(self, *, node_rank: int, num_nodes: int, local_rank: int, ranks_per_node: int, default_name: str) -> None:
        """Place this tier in the job: which node this rank is on (called by the callback at set-up)."""
        if self.erasure is not None:
            k, m = self.erasure
            if num_nodes < k + m:
                raise ConfigError(
                    f"RamTier(erasure=({k}, {m})) places k + m = {k + m} shares on distinct nodes but the job has"
                    f" {num_nodes} node(s): use erasure=None on one node, or a smaller k + m"
                )
        self.node_rank, self.num_nodes = node_rank, num_nodes
        self.local_rank, self.ranks_per_node = local_rank, ranks_per_node
        if self.name is None:
            self.name = default_name
        self._store = None

    def propose_name(self, others: Sequence[str]) -> str:
        """The default run name from this process (see ``name``; rank 0's is used)."""
        return default_run_name(list(others))

    def start_agent(self) -> None:
        """Start the node's snapshot agent unless one answers (the node's first rank, at set-up)."""
        from lightning_snapshot.backends.ram.agent_client import ensure_agent

        ensure_agent(self.node_dir, idle_timeout=self.idle_timeout)

    def connect_agent(
        self, *, rank: int, world_size: int, run_id: str, tiers: Sequence[Backend], part_wait: float
    ) -> NodeAgent:
        """This rank's link to its node's agent (:class:`~lightning_snapshot.agent.AgentClient`)."""
        from lightning_snapshot.backends.ram.agent_client import AgentClient

        return AgentClient(
            self.node_dir, rank=rank, world_size=world_size, run_id=run_id, tiers=list(tiers), part_wait=part_wait
        )

    @property
    def node_dir(self) -> Path:
        """This node's memory directory for this run (the agent's directory)."""
        return Path(self.shm_base or default_shm_base()) / (self.name or "default")

    @property
    def store(self) -> NodeStore:
        """The node's store (opened on first use, after :meth:`bind`)."""
        if self._store is None:
            self._store = node_store(self.node_dir)
        return self._store

    @property
    def node_leader(self) -> bool:
        return self.local_rank == 0

    @property
    def url(self) -> str:
        ec = "none" if self.erasure is None else f"{self.erasure[0]}+{self.erasure[1]}"
        return f"ram://{self.name or ''}?erasure={ec}"

    # ------------------------------------------------------------------------------------------- placement
    def rank_of(self, node: int, local: int) -> int:
        """The rank of local rank ``local`` on node ``node``."""
        return node * self.ranks_per_node + local

    def node_of(self, rank: int) -> int:
        """The node of ``rank``."""
        return rank // self.ranks_per_node

    def held_bytes(self) -> int:
        """Bytes of memory this node's RAM tier holds (its files, as allocated)."""
        return allocated_bytes(self.node_dir / "store")
