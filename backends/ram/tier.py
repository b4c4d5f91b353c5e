"""RAM tier: snapshots in node memory (shared memory held by the node's snapshot agent), erasure coded across nodes.

:class:`RamTier` is made by registry.py (``ram://NAME``) or by the user; it hosts the node's agent
(:class:`~lightning_snapshot.backends.base.NodeAgentHosting`: session.py binds it to the job and has it start and link
the agent), and the engine drives it through the Backend interface (writer.py and persist.py write and
commit, restore.py restores). The agent also uses this module's memory helpers.

Storage: every node has a directory in shared memory (``/dev/shm/lightning-snapshot-<uid>/<run>``, mode 0700, files
0600) that the node's snapshot agent (:mod:`lightning_snapshot.agent`) owns: it outlives the trainer and
frees it after an idle time. The snapshot format is the one of every tier (``step-<n>/manifest.json`` + data
objects); with ``erasure=(k, m)`` a data object is stored as ``<object>.ec/<i>`` shares instead, share ``i`` of an
object written by a rank on node ``n`` living on node ``(n + i) % num_nodes``, with ``<object>.ec/layout.json``
(the share layout and the xxh3 checksum of every share) next to it. Each node holds the manifest of the snapshots it
has shares of.

Commit rule: the manifest is committed on every node only after every rank's shares were placed (the collective
agreement of :func:`~lightning_snapshot.persist.writer.write_snapshot`), so a committed step has all ``k + m`` shares of
every object; it is restorable while at least ``k`` good shares of each are held anywhere.

Restore (:meth:`RamTier.restore`, collective): the nodes exchange what they hold, and every node makes each object
readable from ``k`` shares (its own first, the missing ones sent by the nodes holding them over torch.distributed,
gloo). The data shares hold the object's own bytes, so nothing is copied when the ``k`` data shares are at hand: the
loader reads the object's bytes straight out of them (``<object>.ec/reading.json`` says which files hold them); a
lost data share is rebuilt from parity into a share-sized file first. Shares are not hashed up front: the loader
verifies every chunk it reads against the manifest's checksums, and only when a chunk fails on some rank does every
node hash its shares (against ``layout.json``), treat corrupted ones as missing, rebuild them from the others and
let the failed ranks read again. :meth:`RamTier.finish_restore` frees what the restore added. Cross-node traffic
runs on a gloo group of the trainers made for this tier, never on the trainer's main group from a background thread.

This module holds the tier's options and delegates to its parts, one concern each, which it holds: its place in the
job, its node's store and the agent it hosts (``placement``, :mod:`~lightning_snapshot.backends.ram.placement`), its
bytes in the store (``objects``, :mod:`~lightning_snapshot.backends.ram.store`), the erasure distribution before the
commit (``distribution``, :mod:`~lightning_snapshot.backends.ram.distribution`) and the restore's protocol
(``restoring``, :mod:`~lightning_snapshot.backends.ram.restoring`). The share files
(:mod:`~lightning_snapshot.backends.ram.shares`), a node's inventory and rebuild
(:mod:`~lightning_snapshot.backends.ram.rebuild`) and the node's memory directory and run name
(:mod:`~lightning_snapshot.backends.ram.node`) have their own modules.
"""

from __future__ import annotations

import builtins
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import TypeVar

from typing_extensions import Unpack

from lightning_snapshot.backends.base import Backend, NeededObjects, NodeAgent, ScheduleOptionsKwargs, node_steps
from lightning_snapshot.backends.ram.distribution import ErasureDistribution
from lightning_snapshot.backends.ram.node import (  # (all importable from here too, as before this module was split)
    JOB_ID_VARIABLES,  # noqa: F401
    allocated_bytes,
    default_run_name,  # noqa: F401
    default_shm_base,
    job_ids,  # noqa: F401
)
from lightning_snapshot.backends.ram.node_store import NodeStore, node_store
from lightning_snapshot.backends.ram.placement import RamPlacement
from lightning_snapshot.backends.ram.rebuild import commit_kept
from lightning_snapshot.backends.ram.restoring import RamRestore
from lightning_snapshot.backends.ram.store import RamStore
from lightning_snapshot.dist.comm import Comm

__all__ = ["RamTier", "allocated_bytes", "default_shm_base", "node_store"]

_T = TypeVar("_T")


class RamTier(Backend):
    """Snapshots in node memory, held by a per-node snapshot agent that outlives the trainer.

    Args:
        **schedule: the schedule options every tier takes
            (:class:`~lightning_snapshot.backends.base.ScheduleOptionsKwargs`); ``keep_last`` defaults to 2 here:
            memory is precious.
        erasure: ``None`` keeps a node-local copy of each rank's data (one-node jobs), or ``(k, m)``: each rank's data
            is split into ``k`` data and ``m`` parity shares (zfec) placed on ``k + m`` distinct nodes, so any ``m``
            nodes can be lost at ``(k + m) / k`` times the memory. Needs at least ``k + m`` nodes.
        name: the run's name: one agent and one memory directory per node and name. Default: derived from the
            script, the working directory, the other tiers of the callback and the launcher's job id where one is set
            (``TORCHELASTIC_RUN_ID`` unless ``none``, ``SLURM_JOB_ID``, ``LSB_JOBID``, ``PBS_JOBID``): a restart of
            the same job (torchrun's restarts, a requeued SLURM job) resumes from the node's RAM snapshots, a new job
            starts a new run (it still resumes from the durable tiers). Give a name to share a run across jobs.
        shm_dir: base directory of the node's memory (default ``$LIGHTNING_SNAPSHOT_SHM_DIR`` or
            ``/dev/shm/lightning-snapshot-<uid>``; simulated multi-node runs give every "node" its own).
        idle_timeout: seconds the agent keeps the memory once no trainer is attached, then exits and frees it.
        threads: encoding/decoding threads (default: the cores of the machine, at most 8).

    URL form: ``"ram://run-42?every=10&keep=2&erasure=4+2&idle=600"`` (``ram://?...`` for the default name).
    """

    tier = "ram"
    durable = False
    #: Restores read from shared memory on several threads (the node-local store is thread-safe).
    parallel_reads = 4
    read_piece_bytes = 1 << 20
    #: Each node holds its own objects: the writer commits the manifest on every node (see ``publish``).
    node_local = True
    read_once = False  # (each node reads its own memory: faster than a transfer over gloo)

    default_keep_last = 2  # (memory is precious)

    def __init__(
        self,
        *,
        erasure: tuple[int, int] | str | None = None,
        name: str | None = None,
        shm_dir: str | None = None,
        idle_timeout: float = 600.0,
        threads: int | None = None,
        **schedule: Unpack[ScheduleOptionsKwargs],
    ) -> None:
        super().__init__(**schedule)
        #: Its place in the job, its node's memory and store, the node's agent.
        self.placement = RamPlacement(erasure, name, shm_dir, idle_timeout, threads)
        #: Its bytes in the node's store (erasure coded on write; read from the data shares).
        self.objects = RamStore(self.placement)
        #: The shares of new objects, to their nodes before the commit.
        self.distribution = ErasureDistribution(self.placement, self.objects)
        #: The collective restore.
        self.restoring = RamRestore(self.placement, self.objects)

    # ------------------------------------------------------------------------------------------- identity, parts
    @property
    def url(self) -> str:
        return self.placement.url

    @property
    def erasure(self) -> tuple[int, int] | None:
        """``(k, m)``, or None (a node-local copy of each rank's data)."""
        return self.placement.erasure

    @property
    def name(self) -> str | None:
        """The run's name (None until :meth:`bind` gives the default)."""
        return self.placement.name

    @property
    def idle_timeout(self) -> float:
        return self.placement.idle_timeout

    @property
    def threads(self) -> int | None:
        return self.placement.threads

    @property
    def node_dir(self) -> Path:
        """This node's memory directory for this run (the agent's directory)."""
        return self.placement.node_dir

    @property
    def store(self) -> NodeStore:
        """The node's store: the files of its memory directory."""
        return self.placement.store

    @property
    def node_leader(self) -> bool:
        return self.placement.node_leader

    @property
    def bytes_read(self) -> int:  # type: ignore[override]  # (read-only: the node store's files count)
        return self.objects.bytes_read

    def held_bytes(self) -> int:
        """Bytes of memory this node's RAM tier holds (its files, as allocated)."""
        return self.placement.held_bytes()

    # ------------------------------------------------------------------------------------------- set-up, agent
    def bind(self, *, node_rank: int, num_nodes: int, local_rank: int, ranks_per_node: int, default_name: str) -> None:
        """Place this tier in the job: which node this rank is on (called by the callback at set-up)."""
        self.placement.bind(
            node_rank=node_rank,
            num_nodes=num_nodes,
            local_rank=local_rank,
            ranks_per_node=ranks_per_node,
            default_name=default_name,
        )

    def propose_name(self, others: Sequence[str]) -> str:
        """The default run name from this process (see ``name``; rank 0's is used)."""
        return self.placement.propose_name(others)

    def start_agent(self) -> None:
        """Start the node's snapshot agent unless one answers (the node's first rank, at set-up)."""
        self.placement.start_agent()

    def connect_agent(
        self, *, rank: int, world_size: int, run_id: str, tiers: Sequence[Backend], part_wait: float
    ) -> NodeAgent:
        """This rank's link to its node's agent (:class:`~lightning_snapshot.agent.AgentClient`)."""
        return self.placement.connect_agent(
            rank=rank, world_size=world_size, run_id=run_id, tiers=tiers, part_wait=part_wait
        )

    # ------------------------------------------------------------------------------------------- bytes
    def write(self, key: str, buffers: Iterable[bytes | bytearray | memoryview]) -> int:
        """Write ``key`` in the node's store; a data object is erasure coded (its shares wait for
        :meth:`distribute`)."""
        return self.objects.write(key, buffers)

    def commit(self, key: str, data: bytes) -> None:
        self.objects.commit(key, data)

    def read(self, key: str) -> bytes:
        return self.objects.read(key)

    def read_view(self, key: str) -> memoryview:
        return self.objects.read_view(key)

    def read_into(self, key: str, offset: int, out: memoryview) -> None:
        """Thread-safe. An erasure-coded object that :meth:`prepare_restore` made readable is read straight from
        its data shares."""
        self.objects.read_into(key, offset, out)

    def list(self, prefix: str = "") -> builtins.list[str]:
        return self.objects.list(prefix)

    def delete(self, key: str) -> None:
        self.objects.delete(key)

    def exists(self, key: str) -> bool:
        return self.objects.exists(key)

    def require_exists(self) -> None:
        self.objects.require_exists()

    # ------------------------------------------------------------------------------------------- collective
    def distribute(self, comm: Comm, prefix: str, run_id: str | None) -> None:
        """Send every share of this rank's new objects to its node and keep the ones of this node (collective)."""
        self.distribution.distribute(comm, prefix, run_id)

    def _place_all_here(self) -> None:
        """What :meth:`distribute` does, for one process standing for every node (benchmarks, unit tests)."""
        self.distribution.place_all_here()

    def collective_steps(self, comm: Comm, objects: NeededObjects | None = None) -> builtins.list[int]:
        """Steps committed on any node, newest first (collective: every rank calls it; see
        :func:`~lightning_snapshot.backends.base.node_steps`). The steps the nodes' agents kept here for trainers
        that died are committed first, where every rank's objects are held
        (:func:`~lightning_snapshot.backends.ram.rebuild.commit_kept`)."""
        place = self.placement
        commit_kept(place.store, comm, objects, leader=place.node_leader, url=self.url, threads=place.threads)
        return node_steps(self, comm)

    def restore(self, comm: Comm, step: int, read: Callable[[], _T], needed: NeededObjects | None = None) -> _T:
        """Restore ``step`` (collective; see :meth:`RamRestore.restore
        <lightning_snapshot.backends.ram.restoring.RamRestore.restore>`). Every node makes each object of the step
        it holds shares of readable, so ``needed`` is not used."""
        return self.restoring.restore(comm, step, read)

    def prepare_restore(self, comm: Comm, step: int, *, verify: bool = False) -> None:
        """Make every object of ``step`` readable on this node, rebuilding erasure-coded ones (collective)."""
        self.restoring.prepare_restore(comm, step, verify=verify)

    def finish_restore(self, step: int) -> None:
        """Free what :meth:`prepare_restore` added (every rank calls it)."""
        self.restoring.finish_restore(step)
