"""A fit's wiring: the collectives, a process group per tier, where this rank is in the job, the tiers' checks, the
RAM tier's snapshot agent, the host arena and the persist threads; and their shutdown.

``SnapshotCallback.setup`` opens one :class:`FitSession` (:meth:`FitSession.open`); ``teardown`` and
``on_exception`` close it. Collective: every rank opens it at the same point, and a failure on any rank (a tier that
cannot be written, an agent that does not start) is raised on every rank.
"""

from __future__ import annotations

import datetime as dt
import logging
import uuid
from typing import Any, Protocol

from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lightning_snapshot.backends.base import LayoutSettling, NodeAgent, NodeAgentHosting
from lightning_snapshot.config import SnapshotConfig
from lightning_snapshot.dist.agree import agree_on
from lightning_snapshot.dist.comm import Comm, GroupComm, LocalComm, StrategyComm
from lightning_snapshot.dist.forkprep import pin_gloo_thread_states, prime_operators
from lightning_snapshot.dist.groups import new_gloo_groups, wait_as_long_as
from lightning_snapshot.errors import ConfigError, TierUnavailableError
from lightning_snapshot.persist.threads import Persister
from lightning_snapshot.staging.arena import HostArena

__all__ = ["FitSession", "Job"]

log = logging.getLogger(__name__)


def _trainer_timeout(strategy: Any) -> dt.timedelta:
    """The timeout of the trainer's own collectives: the strategy's ``timeout=`` (DDP, FSDP, ModelParallel), else
    torch's default for a process group."""
    timeout = getattr(strategy, "_timeout", None)
    if isinstance(timeout, dt.timedelta):
        return timeout
    from torch.distributed.distributed_c10d import default_pg_timeout

    return default_pg_timeout


class Job(Protocol):
    """What a session reads of the job it serves (the Trainer, or the Fabric integration's stand-in): the strategy
    (``world_size``, ``global_rank``, ``node_rank``, ``local_rank``, its collectives and ``_timeout``) and the number of
    nodes (optional: 1 when missing). Nothing else."""

    strategy: Any


class FitSession:
    """What one fit's snapshots run on (see the module's docstring). Made by :meth:`open`."""

    def __init__(self, config: SnapshotConfig, comm: Comm, run_id: str) -> None:
        self.config = config
        self.tiers = list(config.tiers)
        self.comm = comm
        #: a random id of this fit, the same on every rank
        self.run_id = run_id
        #: one process group per tier (``LocalComm`` in a single process)
        self.tier_comms: list[Comm] = [LocalComm() for _ in self.tiers]
        #: the training thread's own gloo group (``LocalComm`` in a single process): the preemption agreement's
        #: per-step all-reduce, which must never synchronise a device (the trainer's group may be NCCL)
        self.step_comm: Comm = LocalComm()
        self.arena: HostArena | None = None
        self.persister: Persister | None = None
        #: this rank's link to its node's agent, when a tier hosts one (the RAM tier)
        self.agent: NodeAgent | None = None

    @classmethod
    def open(cls, config: SnapshotConfig, trainer: Job) -> FitSession:
        """Wire a fit (collective). On failure what was started is closed again and the error raised."""
        strategy = trainer.strategy
        prime_operators()  # (before the first collective of this fit: see forkprep)
        comm: Comm = StrategyComm(strategy) if strategy.world_size > 1 else LocalComm()
        session = cls(config, comm, str(comm.broadcast(uuid.uuid4().hex[:12])))
        try:
            session._open(trainer)
        except BaseException:
            session.close(abort=True)
            raise
        return session

    def _open(self, trainer: Job) -> None:
        config = self.config
        self.arena = HostArena(max_host_bytes=config.max_host_bytes, chunk_bytes=config.chunk_bytes)
        if self.comm.world_size > 1:
            # each tier's persist thread has a group of its own: background collectives never touch the trainer's
            # main group, and a tier in an outage never blocks another's commits; a stuck peer fails a collective
            # after collective_timeout (a dead one at once)
            timeout = dt.timedelta(seconds=config.collective_timeout)
            names = [f"the {t.tier} tier {t.url}" for t in self.tiers] + ["the preemption agreement"]
            groups = new_gloo_groups(names, timeout, self.run_id)
            self.tier_comms = [GroupComm(group) for group in groups[:-1]]
            self.step_comm = GroupComm(groups[-1])
            wait_as_long_as(groups[-1], _trainer_timeout(trainer.strategy))
            pin_gloo_thread_states()  # (the trainer's groups and these: a loader worker forked later cannot hang)
        self._setup_node_local_tiers(trainer)
        self._check_tiers()  # (after the local tiers know their node's directory; before the agent starts)
        self._setup_node_agent(trainer)
        self.persister = Persister(self.tiers, self.tier_comms, self.run_id, self.arena, agent=self.agent)
        if self.comm.rank == 0:
            for tier in self.tiers:
                tier.abort_incomplete_uploads()  # multipart uploads left behind by a crashed run

    def store(self) -> Any:
        """The job's key-value store (torch.distributed's default group's), or None when there is none."""
        try:
            from torch.distributed import distributed_c10d as c10d

            get = getattr(c10d, "_get_default_store", None)  # (private in torch: a store every rank reaches)
            return get() if get is not None else None
        except (ImportError, RuntimeError, ValueError) as e:
            log.debug("lightning-snapshot: no default store (%s)", e)
            return None

    def placement(self, trainer: Job) -> dict[str, int]:
        """Where this rank is in the job, as the tiers' ``bind`` takes it: its node, the number of nodes, its rank on
        the node and the ranks per node (at least 1)."""
        strategy = trainer.strategy
        num_nodes = max(1, int(getattr(trainer, "num_nodes", 1) or 1))
        return {
            "node_rank": int(getattr(strategy, "node_rank", 0) or 0),
            "num_nodes": num_nodes,
            "local_rank": int(getattr(strategy, "local_rank", 0) or 0),
            "ranks_per_node": max(1, self.comm.world_size // num_nodes),
        }

    def _setup_node_local_tiers(self, trainer: Job) -> None:
        """Tell each local tier which node this rank is on, and settle whether its directory is shared by all nodes
        or node-local (detected with probe files unless set; one log line each)."""
        placement = self.placement(trainer)
        for i, tier in enumerate(self.tiers):
            if not isinstance(tier, LayoutSettling):
                continue
            local = tier
            local.bind(**placement)
            how = local.settle_layout(self.tier_comms[i], self.run_id)
            if placement["num_nodes"] > 1:
                layout = (
                    "node-local: each node writes its own ranks' data and a copy of the manifest, commits are"
                    " agreed over the process group"
                    if local.node_local
                    else "shared by all nodes"
                )
                rank_zero_info(f"lightning-snapshot: the {tier.tier} tier {tier.url} is {layout} ({how})")

    def _check_tiers(self) -> None:
        """Before training: every rank checks that it can write each durable tier (a probe object written and
        deleted: the directory is writable, the bucket exists, the credentials are accepted, the endpoint answers).

        Collective: every rank raises the same :class:`TierUnavailableError`, naming the rank, the tier and the fix,
        when any rank's check failed.
        """
        problems: list[str] = []
        for tier in self.tiers:
            if not tier.durable:
                continue  # (the RAM tier is checked when its agent starts)
            try:
                tier.check()
            except TierUnavailableError as e:
                problems.append(str(e))
        agreed = agree_on(self.comm, "checking the tiers", error="; ".join(problems) or None)
        if not agreed.ok:
            raise TierUnavailableError(
                f"lightning-snapshot cannot use its tiers, so training does not start: {agreed.text}"
            )

    def _setup_node_agent(self, trainer: Job) -> None:
        """Place the tier that hosts a node agent (the RAM tier) in the job (which node this rank is on) and attach this
        rank to its node's agent."""
        ram = next((t for t in self.tiers if isinstance(t, NodeAgentHosting)), None)
        if ram is None:
            return
        placement = self.placement(trainer)
        world, num_nodes = self.comm.world_size, placement["num_nodes"]
        if world % num_nodes:
            raise ConfigError(
                f"the RAM tier needs the same number of processes on every node ({world} processes on"
                f" {num_nodes} nodes)"
            )
        name = self.comm.broadcast(ram.propose_name([t.url for t in self.tiers if t is not ram]))
        ram.bind(**placement, default_name=name)
        error: BaseException | None = None
        if ram.node_leader:
            try:
                ram.start_agent()
            except Exception as e:  # noqa: BLE001 - raised on every rank below
                error = e
        agree_on(
            self.comm,
            "starting the snapshot agent",
            error=error,
            elsewhere="starting the snapshot agent failed on another node (see its log)",
        ).result()
        # the agent writes the durable tiers whose commit it can see from its node (not the node-local ones, whose
        # commit the trainers agree on over their process group)
        self.agent = ram.connect_agent(
            rank=self.comm.rank,
            world_size=world,
            run_id=self.run_id,
            tiers=[t for t in self.tiers if t is not ram and t.durable and not t.node_local],
            part_wait=self.config.collective_timeout,
        )

    def close(self, abort: bool, timeout: float | None = None) -> None:
        """Stop the background machinery, waiting at most ``timeout`` (default ``shutdown_timeout``) for the persist
        threads (``abort``: after an exception, snapshots still queued are dropped and retries stop)."""
        if self.persister is not None:
            wait = self.config.shutdown_timeout if timeout is None else timeout
            self.persister.close(timeout=wait, abort=abort)
            self.persister = None
        if self.agent is not None:
            self.agent.close()
            self.agent = None
        if self.arena is not None:
            self.arena.close()
            self.arena = None
