"""RAM tier: snapshots in node memory (shared memory held by the node's snapshot agent), erasure coded across nodes.

:class:`RamTier` is made by registry.py (``ram://NAME``) or by the user; it hosts the node's agent
(:class:`~lightning_snapshot.backends.base.NodeAgentHosting`: session.py binds it to the job and has it start and link
the agent), and the engine drives it through the Backend interface (writer.py and persist.py write and
commit, restore.py restores). The agent also uses this module's memory helpers.

Storage: every node has a directory in shared memory (``/dev/shm/lightning-snapshot-<uid>/<run>``, mode 0700, files
0600) that the node's snapshot agent (:mod:`lightning_snapshot.backends.ram.agent`) owns: it outlives the trainer and
frees it after an idle time. The snapshot format is the one of every tier (``step-<n>/manifest.json`` + data
objects); with ``erasure=(k, m)`` a data object is stored as ``<object>.ec/<i>`` shares instead, share ``i`` of an
object written by a rank on node ``n`` living on node ``(n + i) % num_nodes``, with ``<object>.ec/layout.json``
(the share layout and the xxh3 checksum of every share) next to it. Each node holds the manifest of the snapshots it
has shares of.

Commit rule: the manifest is committed on every node only after every rank's shares were placed (the collective
agreement of :func:`~lightning_snapshot.writer.write_snapshot`), so a committed step has all ``k + m`` shares of
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

This module is the tier's own logic (its state, placement, the restore's protocol); the share files
(:mod:`~lightning_snapshot.backends.ram.shares`), a node's inventory and rebuild
(:mod:`~lightning_snapshot.backends.ram.rebuild`) and the node's memory directory and run name
(:mod:`~lightning_snapshot.backends.ram.node`) have their own modules.
"""

from __future__ import annotations

import builtins
import contextlib
import datetime as _dt
import json
import logging
import os
import re
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, TypeVar

from lightning_snapshot.backends.base import Backend, NodeAgent, node_steps
from lightning_snapshot.backends.mapped_files import as_tensor, close_map, map_existing, map_new
from lightning_snapshot.backends.ram import erasure as _ec
from lightning_snapshot.backends.ram.node import (  # (all importable from here too, as before this module was split)
    JOB_ID_VARIABLES,  # noqa: F401
    SHM_ENV,
    allocated_bytes,
    default_run_name,
    default_shm_base,
    job_ids,  # noqa: F401
)
from lightning_snapshot.backends.ram.node_store import NodeStore as _Store
from lightning_snapshot.backends.ram.node_store import node_store
from lightning_snapshot.backends.ram.rebuild import commit_kept, fetch_and_rebuild, inventory
from lightning_snapshot.backends.ram.shares import (
    EC,
    LAYOUT_FILE,
    LAYOUT_KIND,
    READING_FILE,
    SHARE_FILE,
    data_share,
    data_share_nbytes,
    digests,
    layout_of,
    read_exactly,
    view_of,
)
from lightning_snapshot.comm import agree_on
from lightning_snapshot.errors import ConfigError, SnapshotError, SnapshotNotFoundError, SnapshotWriteError

__all__ = ["RamTier", "allocated_bytes", "default_shm_base", "node_store"]

log = logging.getLogger(__name__)
_T = TypeVar("_T")

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


class RamTier(Backend):
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
        self._store: _Store | None = None
        self._pending: dict[str, dict[str, Any]] = {}
        self._sources: dict[str, memoryview] = {}  # key -> the object written, until distribute() sent its shares
        self._readings: dict[str, dict[str, Any]] = {}  # key -> where its data shares are (see prepare_restore)
        self._paths: dict[str, Path] = {}  # key -> its file, checked once (see read_into)

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
        from lightning_snapshot.backends.ram.agent.client import ensure_agent

        ensure_agent(self.node_dir, idle_timeout=self.idle_timeout)

    def connect_agent(
        self, *, rank: int, world_size: int, run_id: str, tiers: Sequence[Backend], part_wait: float
    ) -> NodeAgent:
        """This rank's link to its node's agent (:class:`~lightning_snapshot.backends.ram.agent.AgentClient`)."""
        from lightning_snapshot.backends.ram.agent.client import AgentClient

        return AgentClient(
            self.node_dir, rank=rank, world_size=world_size, run_id=run_id, tiers=list(tiers), part_wait=part_wait
        )

    @property
    def node_dir(self) -> Path:
        """This node's memory directory for this run (the agent's directory)."""
        return Path(self.shm_base or default_shm_base()) / (self.name or "default")

    @property
    def store(self) -> _Store:
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

    # ------------------------------------------------------------------------------------------- bytes
    def write(self, key: str, buffers: Iterable[bytes | bytearray | memoryview]) -> int:
        self._paths.pop(key, None)
        if self.erasure is None or not key.endswith(".bin"):
            return self.store.write(key, buffers)
        views = [memoryview(b).cast("B") for b in buffers]
        data = views[0] if len(views) == 1 else memoryview(bytearray().join(views))
        k, m = self.erasure
        lay = _ec.layout(data.nbytes, k, m)
        ec_dir = self.store._path(key + EC)
        ec_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        # share 0 stays on this node and the parity shares wait here for distribute(); data shares 1..k-1 are the
        # object's own bytes, which distribute() sends from where they lie (the staging arena): no file, no copy
        files = [0, *range(k, k + m)]
        maps: dict[int, Any] = {}
        try:
            for i in files:
                maps[i] = map_new(ec_dir / str(i), lay.share_nbytes)
            _ec.encode(data, lay, [view_of(maps[i]) if i in maps else None for i in range(k + m)], threads=self.threads)
            sums = digests(
                [(view_of(maps[i]), 0) if i in maps else data_share(data, lay, i) for i in range(k + m)], self.threads
            )
        except OSError as e:
            raise SnapshotWriteError(e.errno, f"erasure-coding {key!r} into {ec_dir} failed: {e}") from e
        finally:
            for mm in maps.values():
                close_map(mm)
        self._pending[key] = {
            "layout": LAYOUT_KIND,
            "k": k,
            "m": m,
            "nbytes": lay.nbytes,
            "block": lay.block,
            "stripes": lay.stripes,
            "checksums": sums,
        }
        self._sources[key] = data
        return data.nbytes

    def commit(self, key: str, data: bytes) -> None:
        self.store.commit(key, data)

    def read(self, key: str) -> bytes:
        try:
            return self.store.read(key)
        except FileNotFoundError:
            reading = self._reading(key)
            if reading is None:
                self._need_whole(key)
                raise
        out = bytearray(reading["nbytes"])
        self._read_shares(key, reading, 0, memoryview(out))
        return bytes(out)

    def read_view(self, key: str) -> memoryview:
        try:
            return self.store.read_view(key)
        except FileNotFoundError:
            if self._reading(key) is None:
                self._need_whole(key)
                raise
        return memoryview(self.read(key))

    def read_into(self, key: str, offset: int, out: memoryview) -> None:
        """Thread-safe. An erasure-coded object that :meth:`prepare_restore` made readable is read straight from
        its data shares (one ``preadv`` per data share the range touches: each holds a contiguous run of it)."""
        reading = self._readings.get(key)
        if reading is None:
            # the path is checked once (no symlink out of the tier: ``_path`` resolves every component, some 40 us
            # a call) and remembered until the next write, delete or restore of this tier
            path = self._paths.get(key) or self.store._path(key)
            try:
                fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            except FileNotFoundError:
                reading = self._reading(key)
                if reading is None:
                    self._need_whole(key)
                    raise
            else:
                self._paths[key] = path
                try:
                    view = memoryview(out).cast("B")
                    read_exactly(fd, view, offset, key)
                finally:
                    os.close(fd)
                with self.store._count_lock:
                    self.store.bytes_read += view.nbytes
                return
        self._read_shares(key, reading, offset, out)

    def _reading(self, key: str) -> dict[str, Any] | None:
        """Where the data shares of the erasure-coded ``key`` are, as :meth:`prepare_restore` wrote it (or None)."""
        reading = self._readings.get(key)
        if reading is not None:
            return reading
        try:
            raw = self.store.read(f"{key}{EC}/{READING_FILE}")
            reading = json.loads(raw)
        except (OSError, ValueError):
            return None
        ok = (
            isinstance(reading, dict)
            and all(isinstance(reading.get(f), int) and reading[f] > 0 for f in ("k", "share_nbytes"))
            and isinstance(reading.get("nbytes"), int)
            and reading["nbytes"] <= reading["k"] * reading["share_nbytes"]
        )
        if (
            not ok
            or not isinstance(reading.get("files"), list)
            or len(reading["files"]) != reading["k"]
            or not all(isinstance(f, str) and SHARE_FILE.match(f) for f in reading["files"])
        ):
            raise SnapshotError(f"{key}{EC}/{READING_FILE} in the RAM tier {self.url} is malformed; restore again")
        ec_dir = self.store._path(key + EC)
        reading["paths"] = [os.path.join(ec_dir, f) for f in reading["files"]]  # (joined once: reads are hot)
        self._readings[key] = reading
        return reading

    def _read_shares(self, key: str, reading: dict[str, Any], offset: int, out: memoryview) -> None:
        view = memoryview(out).cast("B")
        n, size = view.nbytes, reading["share_nbytes"]
        if offset < 0 or offset + n > reading["nbytes"]:
            raise EOFError(f"{key!r} has {reading['nbytes']} bytes: [{offset}, {offset + n}) is out of range")
        # data share i holds bytes [i * size, (i + 1) * size) of the object: one read per share touched
        pos = 0
        while pos < n:
            i, at = divmod(offset + pos, size)
            piece = min(size - at, n - pos)
            fd = os.open(reading["paths"][i], os.O_RDONLY | os.O_CLOEXEC)
            try:
                read_exactly(fd, view[pos : pos + piece], at, key)
            finally:
                os.close(fd)
            pos += piece
        with self.store._count_lock:
            self.store.bytes_read += n

    @property
    def bytes_read(self) -> int:  # type: ignore[override]  # (read-only here: the node store counts)
        return self.store.bytes_read

    def _need_whole(self, key: str) -> None:
        if not self.store.exists(key) and self.store._path(key + EC).is_dir():
            raise SnapshotNotFoundError(
                f"{key!r} is erasure coded in the RAM tier {self.url}; it is rebuilt by prepare_restore() (the"
                " callback does this on resume)"
            )

    def list(self, prefix: str = "") -> list[str]:
        names = {n[: -len(EC)] if n.endswith(EC) else n for n in self.store.list(prefix)}
        return sorted(names)

    def delete(self, key: str) -> None:
        self._paths.clear()
        self.store.delete(key)
        if key:
            self.store.delete(key + EC)

    def exists(self, key: str) -> bool:
        return self.store.exists(key) or (key.endswith(".bin") and self.store._path(key + EC).is_dir())

    def require_exists(self) -> None:
        if (self.node_dir / "store").is_dir():
            return
        base = self.node_dir.parent
        try:
            names = sorted(p.name for p in base.iterdir() if (p / "store").is_dir())
        except OSError:
            names = []
        here = (
            f"RAM tiers on this node: {', '.join(f'ram://{n}' for n in names)}"
            if names
            else "this node holds no RAM tier"
        )
        raise SnapshotNotFoundError(
            f"no RAM tier named {self.name or 'default'!r} on this node ({self.node_dir} does not exist); {here}"
            f" under {str(base)!r}. Name the run as ram://NAME, or set {SHM_ENV} to the base directory the job used"
        )

    # ------------------------------------------------------------------------------------------- placement
    def _rank_of(self, node: int, local: int) -> int:
        return node * self.ranks_per_node + local

    def _node_of(self, rank: int) -> int:
        return rank // self.ranks_per_node

    def distribute(self, comm: Any, prefix: str, run_id: str | None) -> None:
        """Send every share of this rank's new objects to its node and keep the ones of this node (collective)."""
        pending, self._pending = self._pending, {}
        sources, self._sources = self._sources, {}
        if self.erasure is None:
            return
        k, m = self.erasure
        mine = {key: meta for key, meta in pending.items() if key.startswith(prefix + "/")}
        everyone = comm.all_gather(mine) if comm.world_size > 1 else [mine]
        import torch.distributed as dist

        n, n_nodes = self.node_rank, self.num_nodes
        sends, recvs, keep, held = [], [], [], []
        try:
            for i in range(1, k + m):
                dst = self._rank_of((n + i) % n_nodes, self.local_rank)
                src = self._rank_of((n - i) % n_nodes, self.local_rank)
                for key, meta in sorted(mine.items()):
                    if i < k:  # the object's bytes of data share i (past the object's end the share is zeros)
                        part, _pad = data_share(sources[key], layout_of(meta), i)
                        if part.nbytes:
                            held.append(as_tensor(part))
                            sends.append(dist.isend(held[-1], dst, group=comm.group))
                        continue
                    mm = map_existing(self.store._path(f"{key}{EC}/{i}"))
                    if mm is not None:
                        keep.append(mm)
                        sends.append(dist.isend(as_tensor(mm), dst, group=comm.group))
                for key, meta in sorted(everyone[src].items()):
                    path = self.store._path(f"{key}{EC}/{i}")
                    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
                    lay = layout_of(meta)
                    mm = map_new(path, lay.share_nbytes)  # (zeros until received)
                    if mm is not None:
                        keep.append(mm)
                        size = data_share_nbytes(lay, i) if i < k else lay.share_nbytes
                        if size:
                            recvs.append(dist.irecv(as_tensor(mm)[:size], src, group=comm.group))
            for w in sends + recvs:
                if w is not None:  # (None: this rank is not in the group, nothing was posted)
                    w.wait()
        finally:
            sends.clear()
            recvs.clear()
            held.clear()
            for mm in keep:
                close_map(mm)
        # this node keeps share 0 of its own objects and share i of the objects of node n - i
        for key in mine:
            for i in range(k, k + m):
                self.store.delete(f"{key}{EC}/{i}")
        for r, objs in enumerate(everyone):
            if r % self.ranks_per_node != self.local_rank:
                continue  # the ranks with this local rank exchange with each other
            for key, meta in objs.items():
                i = (n - self._node_of(r)) % n_nodes
                if i >= k + m:
                    continue
                layout = {**meta, "nodes": [(self._node_of(r) + j) % n_nodes for j in range(k + m)]}
                self.store.write(f"{key}{EC}/{LAYOUT_FILE}", [json.dumps(layout).encode()])

    def _place_all_here(self) -> None:
        """What :meth:`distribute` does, for one process standing for every node (benchmarks, unit tests): every
        share of the new objects is kept in this node's directory, with the ``layout.json`` of each."""
        pending, self._pending = self._pending, {}
        sources, self._sources = self._sources, {}
        for key, meta in pending.items():
            lay = layout_of(meta)
            for i in range(1, lay.k):
                part, _pad = data_share(sources[key], lay, i)
                mm = map_new(self.store._path(f"{key}{EC}/{i}"), lay.share_nbytes)
                try:
                    view_of(mm)[: part.nbytes] = part
                finally:
                    close_map(mm)
            layout = {**meta, "nodes": [self.node_rank] * (lay.k + lay.m)}
            self.store.write(f"{key}{EC}/{LAYOUT_FILE}", [json.dumps(layout).encode()])

    # ------------------------------------------------------------------------------------------- restore
    def collective_steps(self, comm: Any) -> builtins.list[int]:  # (``list`` here is the method above)
        """Steps committed on any node, newest first (collective: every rank calls it; see
        :func:`~lightning_snapshot.backends.base.node_steps`). The steps the nodes' agents kept here for trainers
        that died are committed first, where every rank's objects are held
        (:func:`~lightning_snapshot.backends.ram.rebuild.commit_kept`)."""
        commit_kept(self.store, comm, leader=self.node_leader, url=self.url, threads=self.threads)
        return node_steps(self, comm)

    def restore(self, comm: Any, step: int, read: Callable[[], _T]) -> _T:
        """Restore ``step`` from this tier (collective): :meth:`prepare_restore`, ``read()``, :meth:`finish_restore`.

        ``read`` reads what this rank needs and verifies every chunk against the manifest's checksums (the
        loader's :func:`~lightning_snapshot.loader.read_section` does). Shares are trusted at first, so that an
        intact snapshot costs one verified read of its bytes and no hashing of shares; if a chunk fails its
        checksum on any rank (a corrupted share), every node hashes its shares, corrupted ones are treated as
        missing and rebuilt from the good ones, and the ranks whose read failed read again.

        Raises:
            what ``read`` raises (after the verified retry, for a checksum mismatch), or what
            :meth:`prepare_restore` raises.
        """
        from lightning_snapshot.errors import ChecksumError

        world = getattr(comm, "world_size", 1)
        self.prepare_restore(comm, step)
        try:
            error: Exception | None = None
            result: Any = None
            try:
                result = read()
            except Exception as e:  # noqa: BLE001 - every rank must reach the collective below
                error = e
            corrupt = isinstance(error, ChecksumError)
            if world > 1:
                corrupt = not agree_on(comm, f"reading step {step} from the RAM tier", flags=[not corrupt]).flags[0]
            if corrupt and self.erasure is not None:
                if getattr(comm, "rank", 0) == 0:
                    log.warning(
                        "lightning-snapshot: RAM tier %s: a chunk of step %d failed its checksum; verifying"
                        " every share and rebuilding the corrupted ones from the others (%s)",
                        self.url,
                        step,
                        error if error is not None else "on another rank",
                    )
                self.finish_restore(step)
                if world > 1:
                    comm.barrier()
                self.prepare_restore(comm, step, verify=True)
                if error is not None:
                    error = None
                    try:
                        result = read()
                    except Exception as e:  # noqa: BLE001 - raised below, after finish_restore
                        error = e
            if error is not None:
                raise error
            return result
        finally:
            self.finish_restore(step)

    def prepare_restore(self, comm: Any, step: int, *, verify: bool = False) -> None:
        """Make every object of ``step`` readable on this node, rebuilding erasure-coded ones (collective).

        ``verify=False`` trusts every share of the right size (the loader verifies each chunk it reads: see
        :meth:`restore`); ``verify=True`` hashes every share first and treats a mismatching one as missing.

        Raises:
            SnapshotError: some object has fewer than ``k`` good shares left on all nodes together (naming it).
        """
        from lightning_snapshot.manifest import MANIFEST_NAME, step_dirname

        prefix = step_dirname(step)
        world = getattr(comm, "world_size", 1)
        self._readings.clear()
        self._paths.clear()
        inv = inventory(self.store, prefix, leader=self.node_leader, verify=verify, threads=self.threads)
        for bad in inv["bad"]:
            log.warning("lightning-snapshot: RAM tier %s, node %d: %s", self.url, self.node_rank, bad)
        invs = comm.all_gather(inv) if world > 1 else [inv]
        leaders = [r for r in range(world) if r % self.ranks_per_node == 0]
        manifest = next((invs[r]["manifest"] for r in leaders if invs[r]["manifest"]), None)
        if manifest is None:
            raise SnapshotNotFoundError(f"no node holds the manifest of step {step} in the RAM tier {self.url}")
        # what exists where (by leader rank)
        keys = set()
        for r in leaders:
            keys |= set(invs[r]["whole"]) | set(invs[r]["shares"])
        layouts: dict[str, dict[str, Any]] = {}
        holders: dict[str, dict[int, list[int]]] = {}  # key -> share index -> leader ranks holding it
        whole_at: dict[str, list[int]] = {}
        for r in leaders:
            for key in invs[r]["whole"]:
                whole_at.setdefault(key, []).append(r)
            for key, e in invs[r]["shares"].items():
                layouts.setdefault(key, e["layout"])
                for i in e["good"]:
                    holders.setdefault(key, {}).setdefault(i, []).append(r)
        broken = {key: why for r in leaders for key, why in invs[r]["broken"].items()}
        for key in sorted(keys | set(broken)):
            if key in whole_at:
                continue
            if key not in layouts:
                raise SnapshotError(f"the RAM tier {self.url} cannot rebuild {key!r} of step {step}: {broken[key]}")
            k = layouts[key]["k"]
            have = sorted(holders.get(key, {}))
            if len(have) < k:
                raise SnapshotError(
                    f"the RAM tier {self.url} cannot rebuild {key!r} of step {step}: {len(have)} good share(s) of"
                    f" the {k} needed are left (shares {have}; nodes lost or shares corrupted)"
                )
        # plan: every leader gets what it lacks, from the lowest leader that has it
        transfers: list[tuple[int, int, str, int]] = []  # (src, dst, key, share index; -1 = whole object)
        for dst in leaders:
            for key in sorted(keys):
                if key in invs[dst]["whole"]:
                    continue
                if key in whole_at:
                    transfers.append((whole_at[key][0], dst, key, -1))
                    continue
                own = set(invs[dst]["shares"].get(key, {}).get("good", []))
                need = layouts[key]["k"] - len(own)
                for i in sorted(holders[key]):
                    if need <= 0:
                        break
                    if i not in own:
                        transfers.append((holders[key][i][0], dst, key, i))
                        need -= 1
        me = getattr(comm, "rank", 0)
        if me in leaders:
            verified = {key: set(e["good"]) for key, e in invs[me]["shares"].items()}
            fetch_and_rebuild(
                self.store, comm, transfers, layouts, me, prefix, manifest, verified, verify, self.threads
            )
        if world > 1:
            comm.barrier()
        if me in leaders and not self.store.exists(f"{prefix}/{MANIFEST_NAME}"):
            self.store.commit(f"{prefix}/{MANIFEST_NAME}", manifest.encode())
        if world > 1:
            comm.barrier()

    def finish_restore(self, step: int) -> None:
        """Free what :meth:`prepare_restore` added: received and rebuilt shares, whole objects it got from peers
        (the node's own shares stay). Every rank calls it."""
        from lightning_snapshot.manifest import step_dirname

        self._readings.clear()
        self._paths.clear()
        if self.erasure is None or not self.node_leader:
            return
        prefix = step_dirname(step)
        for name in self.store.list(prefix):
            if name.endswith(EC):
                self.store.delete(f"{prefix}/{name[: -len(EC)]}")
                ec_dir = self.store._path(f"{prefix}/{name}")
                for entry in os.listdir(ec_dir) if ec_dir.is_dir() else []:
                    if entry == READING_FILE or (entry.startswith(".") and SHARE_FILE.match(entry)):
                        with contextlib.suppress(OSError):
                            os.unlink(ec_dir / entry)

    def held_bytes(self) -> int:
        """Bytes of memory this node's RAM tier holds (its files, as allocated)."""
        return allocated_bytes(self.node_dir / "store")
