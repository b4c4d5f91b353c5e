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

This module holds the tier's options and process state. Its logic is in its base classes, one concern each:
its place in the job, its node's store and the agent it hosts (:mod:`~lightning_snapshot.backends.ram.placement`),
its bytes in the store (:mod:`~lightning_snapshot.backends.ram.store`), the erasure distribution before the commit
(:mod:`~lightning_snapshot.backends.ram.distribution`) and the restore's protocol
(:mod:`~lightning_snapshot.backends.ram.restoring`). The share files (:mod:`~lightning_snapshot.backends.ram.shares`),
a node's inventory and rebuild (:mod:`~lightning_snapshot.backends.ram.rebuild`) and the node's memory directory and
run name (:mod:`~lightning_snapshot.backends.ram.node`) have their own modules.
"""

from __future__ import annotations

import datetime as _dt
import re

from lightning_snapshot.backends.ram.distribution import ErasureDistribution
from lightning_snapshot.backends.ram.node import (  # (all importable from here too, as before this module was split)
    JOB_ID_VARIABLES,  # noqa: F401
    allocated_bytes,
    default_run_name,  # noqa: F401
    default_shm_base,
    job_ids,  # noqa: F401
)
from lightning_snapshot.backends.ram.node_store import node_store
from lightning_snapshot.backends.ram.placement import parse_erasure
from lightning_snapshot.backends.ram.restoring import RamRestore
from lightning_snapshot.errors import ConfigError

__all__ = ["RamTier", "allocated_bytes", "default_shm_base", "node_store"]

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


class RamTier(RamRestore, ErasureDistribution):
    """Snapshots in node memory, held by a per-node snapshot agent that outlives the trainer.

    Args:
        every_n_train_steps, train_time_interval, keep_last, min_every, max_every: see
            :class:`~lightning_snapshot.backends.base.Backend`
            (``keep_last`` defaults to 2 here: memory is precious).
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

    def __init__(
        self,
        every_n_train_steps: int | str | None = None,
        train_time_interval: _dt.timedelta | float | None = None,
        keep_last: int | None = 2,
        erasure: tuple[int, int] | str | None = None,
        *,
        min_every: int | None = None,
        max_every: int | None = None,
        name: str | None = None,
        shm_dir: str | None = None,
        idle_timeout: float = 600.0,
        threads: int | None = None,
    ) -> None:
        super().__init__(
            every_n_train_steps=every_n_train_steps,
            train_time_interval=train_time_interval,
            keep_last=keep_last,
            min_every=min_every,
            max_every=max_every,
        )
        self.erasure = parse_erasure(erasure)
        if name is not None and (not isinstance(name, str) or not _NAME.match(name)):
            raise ConfigError(f"RamTier name must be 1-128 letters, digits, '.', '_' or '-', got {name!r}")
        if isinstance(idle_timeout, bool) or not isinstance(idle_timeout, (int, float)) or idle_timeout <= 0:
            raise ConfigError(f"idle_timeout must be a positive number of seconds, got {idle_timeout!r}")
        if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or threads < 1):
            raise ConfigError(f"threads must be an integer >= 1 or None, got {threads!r}")
        self.name = name
        self.shm_base = shm_dir
        self.idle_timeout = float(idle_timeout)
        self.threads = threads
        # topology (bind): single node until the callback says otherwise
        self.node_rank, self.num_nodes, self.local_rank, self.ranks_per_node = 0, 1, 0, 1
        self._init_process_state()

    _process_local = ("_store", "_pending", "_sources", "_readings", "_paths")

    def _init_process_state(self) -> None:
        super()._init_process_state()
        self._store = None
        self._pending = {}
        self._sources = {}  # key -> the object written, until distribute() sent its shares
        self._readings = {}  # key -> where its data shares are (see prepare_restore)
        self._paths = {}  # key -> its file, checked once (see read_into)
