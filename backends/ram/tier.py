"""RAM tier: snapshots in node memory (shared memory held by the node's snapshot agent), erasure coded across nodes.

Storage: every node has a directory in shared memory (``/dev/shm/lightning-snapshot-<uid>/<run>``, mode 0700, files
0600) that the node's snapshot agent (:mod:`lightning_snapshot.backends.ram.agent`) owns: it outlives the trainer and frees it
after an idle time. The snapshot format is the one of every tier (``step-<n>/manifest.json`` + data objects); with
``erasure=(k, m)`` a data object is stored as ``<object>.ec/<i>`` shares instead, share ``i`` of an object written by
a rank on node ``n`` living on node ``(n + i) % num_nodes``, with ``<object>.ec/layout.json`` (the share layout and
the xxh3 checksum of every share) next to it. Each node holds the manifest of the snapshots it has shares of.

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
"""

from __future__ import annotations

import concurrent.futures as cf
import datetime as _dt
import hashlib
import json
import logging
import mmap
import os
import re
import sys
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, TypeVar

import xxhash

from lightning_snapshot.backends.ram import erasure as _ec
from lightning_snapshot.backends.base import Backend
from lightning_snapshot.backends.local import (
    LocalTier,
    _as_tensor,
    _close,
    _map_existing,
    _map_new,
    _pread_all,
    exchange,
)
from lightning_snapshot.errors import ConfigError, SnapshotError, SnapshotNotFoundError, SnapshotWriteError
from lightning_snapshot.staging import digest

__all__ = ["RamTier", "allocated_bytes", "default_shm_base"]

log = logging.getLogger(__name__)
_T = TypeVar("_T")

SHM_ENV = "LIGHTNING_SNAPSHOT_SHM_DIR"
_EC = ".ec"
_LAYOUT = "layout.json"
_READING = "reading.json"
#: How ``layout.json`` says its object is cut (see :mod:`lightning_snapshot.backends.erasure`): contiguous data shares.
_LAYOUT_KIND = "contiguous-v1"
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_SHARE_FILE = re.compile(r"^(\d+|\.\d+\.(restore|rebuilt))$")


def default_shm_base() -> str:
    """Where nodes keep RAM-tier memory: ``$LIGHTNING_SNAPSHOT_SHM_DIR``, else ``/dev/shm/lightning-snapshot-<uid>``."""
    env = os.environ.get(SHM_ENV)
    if env:
        return env
    base = "/dev/shm" if os.path.isdir("/dev/shm") else os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, f"lightning-snapshot-{os.getuid()}")


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


class _Store(LocalTier):
    """The node's files: no O_DIRECT (tmpfs), owner-only permissions."""

    tier = "ram"
    durable = False
    file_mode = 0o600


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

    @property
    def node_dir(self) -> Path:
        """This node's memory directory for this run (the agent's directory)."""
        return Path(self.shm_base or default_shm_base()) / (self.name or "default")

    @property
    def store(self) -> _Store:
        if self._store is None:
            d = self.node_dir
            d.mkdir(mode=0o700, parents=True, exist_ok=True)
            os.chmod(d, 0o700)
            (d / "store").mkdir(mode=0o700, exist_ok=True)
            self._store = _Store(d / "store", keep_last=None)
            self._store.direct_io = False
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
        ec_dir = self.store._path(key + _EC)
        ec_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        # share 0 stays on this node and the parity shares wait here for distribute(); data shares 1..k-1 are the
        # object's own bytes, which distribute() sends from where they lie (the staging arena): no file, no copy
        files = [0, *range(k, k + m)]
        maps: dict[int, Any] = {}
        try:
            for i in files:
                maps[i] = _map_new(ec_dir / str(i), lay.share_nbytes)
            _ec.encode(data, lay, [_view(maps[i]) if i in maps else None for i in range(k + m)], threads=self.threads)
            sums = _digests(
                [(_view(maps[i]), 0) if i in maps else _data_share(data, lay, i) for i in range(k + m)], self.threads
            )
        except OSError as e:
            raise SnapshotWriteError(e.errno, f"erasure-coding {key!r} into {ec_dir} failed: {e}") from e
        finally:
            for mm in maps.values():
                _close(mm)
        self._pending[key] = {
            "layout": _LAYOUT_KIND,
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

    def publish(self, comm: Any, key: str, data: bytes) -> None:
        """Commit the manifest on this node (one rank per node writes it)."""
        if self.node_leader:
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
                    _read_exactly(fd, view, offset, key)
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
            raw = self.store.read(f"{key}{_EC}/{_READING}")
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
            or not all(isinstance(f, str) and _SHARE_FILE.match(f) for f in reading["files"])
        ):
            raise SnapshotError(f"{key}{_EC}/{_READING} in the RAM tier {self.url} is malformed; restore again")
        ec_dir = self.store._path(key + _EC)
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
                _read_exactly(fd, view[pos : pos + piece], at, key)
            finally:
                os.close(fd)
            pos += piece
        with self.store._count_lock:
            self.store.bytes_read += n

    @property
    def bytes_read(self) -> int:
        return self.store.bytes_read

    def _need_whole(self, key: str) -> None:
        if not self.store.exists(key) and self.store._path(key + _EC).is_dir():
            raise SnapshotNotFoundError(
                f"{key!r} is erasure coded in the RAM tier {self.url}; it is rebuilt by prepare_restore() (the"
                " callback does this on resume)"
            )

    def list(self, prefix: str = "") -> list[str]:
        names = {n[: -len(_EC)] if n.endswith(_EC) else n for n in self.store.list(prefix)}
        return sorted(names)

    def delete(self, key: str) -> None:
        self._paths.clear()
        self.store.delete(key)
        if key:
            self.store.delete(key + _EC)

    def exists(self, key: str) -> bool:
        return self.store.exists(key) or (key.endswith(".bin") and self.store._path(key + _EC).is_dir())

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

    def distribute(self, comm: Any, prefix: str, run_id: str) -> None:
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
                        part, _pad = _data_share(sources[key], _layout_of(meta), i)
                        if part.nbytes:
                            held.append(_as_tensor(part))
                            sends.append(dist.isend(held[-1], dst, group=comm.group))
                        continue
                    mm = _map_existing(self.store._path(f"{key}{_EC}/{i}"))
                    if mm is not None:
                        keep.append(mm)
                        sends.append(dist.isend(_as_tensor(mm), dst, group=comm.group))
                for key, meta in sorted(everyone[src].items()):
                    path = self.store._path(f"{key}{_EC}/{i}")
                    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
                    lay = _layout_of(meta)
                    mm = _map_new(path, lay.share_nbytes)  # (zeros until received)
                    if mm is not None:
                        keep.append(mm)
                        size = _data_share_nbytes(lay, i) if i < k else lay.share_nbytes
                        if size:
                            recvs.append(dist.irecv(_as_tensor(mm)[:size], src, group=comm.group))
            for w in sends + recvs:
                w.wait()
        finally:
            sends.clear()
            recvs.clear()
            held.clear()
            for mm in keep:
                _close(mm)
        # this node keeps share 0 of its own objects and share i of the objects of node n - i
        for key in mine:
            for i in range(k, k + m):
                self.store.delete(f"{key}{_EC}/{i}")
        for r, objs in enumerate(everyone):
            if r % self.ranks_per_node != self.local_rank:
                continue  # the ranks with this local rank exchange with each other
            for key, meta in objs.items():
                i = (n - self._node_of(r)) % n_nodes
                if i >= k + m:
                    continue
                layout = {**meta, "nodes": [(self._node_of(r) + j) % n_nodes for j in range(k + m)]}
                self.store.write(f"{key}{_EC}/{_LAYOUT}", [json.dumps(layout).encode()])

    def _place_all_here(self) -> None:
        """What :meth:`distribute` does, for one process standing for every node (benchmarks, unit tests): every
        share of the new objects is kept in this node's directory, with the ``layout.json`` of each."""
        pending, self._pending = self._pending, {}
        sources, self._sources = self._sources, {}
        for key, meta in pending.items():
            lay = _layout_of(meta)
            for i in range(1, lay.k):
                part, _pad = _data_share(sources[key], lay, i)
                mm = _map_new(self.store._path(f"{key}{_EC}/{i}"), lay.share_nbytes)
                try:
                    _view(mm)[: part.nbytes] = part
                finally:
                    _close(mm)
            layout = {**meta, "nodes": [self.node_rank] * (lay.k + lay.m)}
            self.store.write(f"{key}{_EC}/{_LAYOUT}", [json.dumps(layout).encode()])

    # ------------------------------------------------------------------------------------------- restore
    def collective_steps(self, comm: Any) -> list[int]:
        """Steps committed on any node, newest first (collective: every rank calls it)."""
        from lightning_snapshot.writer import committed_steps

        mine = committed_steps(self) if self.node_leader else []
        if getattr(comm, "world_size", 1) > 1:
            return sorted({s for steps in comm.all_gather(mine) for s in steps}, reverse=True)
        return mine

    def _inventory(self, prefix: str, verify: bool) -> dict[str, Any]:
        """What this node holds of ``prefix``: the manifest text, whole objects and its shares of the right size
        (``verify``: only those whose xxh3 matches the layout's)."""
        from lightning_snapshot.manifest import MANIFEST_NAME

        inv: dict[str, Any] = {"manifest": None, "whole": {}, "shares": {}, "bad": [], "broken": {}}
        if not self.node_leader:
            return inv
        try:
            inv["manifest"] = self.store.read(f"{prefix}/{MANIFEST_NAME}").decode()
        except (OSError, UnicodeDecodeError):
            pass
        checks: list[tuple[str, int, str, dict[str, Any]]] = []  # (key, share index, share key, layout)
        for name in self.store.list(prefix):
            if name.endswith(_EC):
                key = f"{prefix}/{name[: -len(_EC)]}"
                try:
                    layout = _parse_layout(self.store.read(f"{prefix}/{name}/{_LAYOUT}"), key)
                except (OSError, SnapshotError) as e:
                    inv["bad"].append(f"{key}: {e}")
                    inv["broken"][key] = str(e)
                    continue
                inv["shares"][key] = {"layout": layout, "good": []}
                for entry in self.store.list(f"{prefix}/{name}"):
                    if entry.isdigit() and int(entry) < len(layout["checksums"]):
                        checks.append((key, int(entry), f"{prefix}/{name}/{entry}", layout))
            elif name.endswith(".bin"):
                inv["whole"][f"{prefix}/{name}"] = True

        def check(item: tuple[str, int, str, dict[str, Any]]) -> bool:
            _key, i, share, layout = item
            return _share_ok(
                self.store._path(share), layout["stripes"] * layout["block"], layout["checksums"][i], verify
            )

        # every share hashed once, on as many threads as the tier codes with (xxh3 releases the GIL)
        workers = min(len(checks), self.threads or min(8, os.cpu_count() or 1)) if verify else 1
        if workers > 1:
            with cf.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="lightning-snapshot-verify") as pool:
                results = list(pool.map(check, checks))
        else:
            results = [check(c) for c in checks]
        for (key, i, _share, _layout), ok in zip(checks, results):
            if ok:
                inv["shares"][key]["good"].append(i)
            else:
                why = "checksum mismatch" if verify else "wrong size"
                inv["bad"].append(f"{key} share {i} ({why}: corrupted, treated as missing)")
        return inv

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
                corrupt = not comm.all_true(not corrupt)  # on any rank
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
        inv = self._inventory(prefix, verify)
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
            self._execute(comm, transfers, layouts, me, prefix, manifest, verified, verify)
        if world > 1:
            comm.barrier()
        if me in leaders and not self.store.exists(f"{prefix}/{MANIFEST_NAME}"):
            self.store.commit(f"{prefix}/{MANIFEST_NAME}", manifest.encode())
        if world > 1:
            comm.barrier()

    def _execute(
        self,
        comm: Any,
        transfers: list[tuple[int, int, str, int]],
        layouts: dict[str, dict[str, Any]],
        me: int,
        prefix: str,
        manifest: str,
        verified: dict[str, set[int]],
        verify: bool,
    ) -> None:
        """Run this leader's part of the ``transfers`` and rebuild every erasure-coded object from ``k`` good
        shares: its own that ``_inventory`` listed (``verified``), the others checked here (``verify``: hashed)."""
        from lightning_snapshot.manifest import Manifest

        sizes = {o.key: o.nbytes for o in Manifest.from_json(manifest, where=f"RAM tier manifest of {prefix}").objects}
        sends: list[tuple[Any, int]] = []
        receives: list[tuple[Any, int]] = []
        received: dict[str, dict[int, Any]] = {}
        try:
            if transfers and getattr(comm, "world_size", 1) > 1:
                for src, dst, key, i in transfers:
                    if src == dst or me not in (src, dst):
                        continue
                    if i < 0:
                        path = self.store._path(key)
                        size = sizes[key.rsplit("/", 1)[1]]
                    else:
                        path = self.store._path(f"{key}{_EC}/{i}")
                        size = layouts[key]["stripes"] * layouts[key]["block"]
                    if me == src:
                        sends.append((_map_existing(path), dst))
                    else:
                        rpath = path if i < 0 else path.with_name(f".{i}.restore")
                        rpath.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
                        receives.append((_map_new(rpath, size), src))
                        if i >= 0:
                            received.setdefault(key, {})[i] = rpath
        except BaseException:
            for mm, _peer in sends + receives:
                _close(mm)
            raise
        exchange(getattr(comm, "group", None), sends, receives)
        # make every erasure-coded object readable from its data shares, rebuilding the lost ones from parity
        for key, layout in layouts.items():
            if self.store.exists(key):
                continue
            lay = _ec.ShareLayout(layout["k"], layout["m"], layout["nbytes"], layout["block"], layout["stripes"])
            paths: dict[int, Path] = dict(received.get(key, {}))
            inv_dir = self.store._path(key + _EC)
            for entry in sorted(os.listdir(inv_dir)) if inv_dir.is_dir() else []:
                if entry.isdigit() and int(entry) not in paths and int(entry) < lay.k + lay.m:
                    paths[int(entry)] = inv_dir / entry
            maps: dict[int, Any] = {}
            used: set[Path] = set()
            try:
                for i, p in sorted(paths.items()):
                    if i not in verified.get(key, ()) and not _share_ok(
                        p, lay.share_nbytes, layout["checksums"][i], verify
                    ):
                        continue
                    maps[i] = _map_existing(p, write=False)
                    if len(maps) == lay.k:
                        break
                lost = [i for i in range(lay.k) if i not in maps]
                outs = {i: _map_new(inv_dir / f".{i}.rebuilt", lay.share_nbytes) for i in lost if len(maps) >= lay.k}
                try:
                    _ec.rebuild(
                        {i: _view(mm) for i, mm in maps.items()},
                        lay,
                        {i: _view(mm) for i, mm in outs.items()},
                        threads=self.threads,
                    )
                finally:
                    for mm in outs.values():
                        _close(mm)
                files = [f".{i}.rebuilt" if i in outs else paths[i].name for i in range(lay.k)]
                used = {inv_dir / f for f in files}
                self.store.write(
                    f"{key}{_EC}/{_READING}",
                    [
                        json.dumps(
                            {"k": lay.k, "share_nbytes": lay.share_nbytes, "nbytes": lay.nbytes, "files": files}
                        ).encode()
                    ],
                )
            finally:
                for mm in maps.values():
                    _close(mm)
                for p in received.get(key, {}).values():
                    if p not in used:
                        try:
                            os.unlink(p)
                        except OSError:
                            pass

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
            if name.endswith(_EC):
                self.store.delete(f"{prefix}/{name[: -len(_EC)]}")
                ec_dir = self.store._path(f"{prefix}/{name}")
                for entry in os.listdir(ec_dir) if ec_dir.is_dir() else []:
                    if entry == _READING or (entry.startswith(".") and _SHARE_FILE.match(entry)):
                        try:
                            os.unlink(ec_dir / entry)
                        except OSError:
                            pass

    def held_bytes(self) -> int:
        """Bytes of memory this node's RAM tier holds (its files, as allocated)."""
        return allocated_bytes(self.node_dir / "store")


def allocated_bytes(path: str | os.PathLike[str]) -> int:
    """Bytes the files under ``path`` occupy (allocated blocks: what shared memory really holds)."""
    total = 0
    for root, _dirs, files in os.walk(path):
        for f in files:
            try:
                total += os.stat(os.path.join(root, f)).st_blocks * 512
            except OSError:
                pass
    return total


#: Environment variables in which a launcher or scheduler names the job. Each keeps its value when the same job
#: restarts (torchrun's restarts of its workers, a requeued SLURM, LSF or PBS job) and changes for a new job, so a new
#: job never resumes from the RAM snapshots another job left on the node. torchrun's default run id, ``none``, names
#: no job and is ignored.
JOB_ID_VARIABLES = ("TORCHELASTIC_RUN_ID", "SLURM_JOB_ID", "LSB_JOBID", "PBS_JOBID")


def job_ids(environ: Any = None) -> list[str]:
    """``VARIABLE=value`` of each :data:`JOB_ID_VARIABLES` set (to something other than torchrun's ``none``)."""
    env = os.environ if environ is None else environ
    found = []
    for var in JOB_ID_VARIABLES:
        value = str(env.get(var, "")).strip()
        if value and not (var == "TORCHELASTIC_RUN_ID" and value.lower() == "none"):
            found.append(f"{var}={value}")
    return found


def default_run_name(tier_urls: list[str]) -> str:
    """A run name for the agent and memory directory: the same script, working directory, other tiers and launcher
    job id (:data:`JOB_ID_VARIABLES`, where one is set) mean the same run."""
    text = "\n".join(
        [os.getcwd(), os.path.abspath(sys.argv[0]) if sys.argv and sys.argv[0] else "", *tier_urls, *job_ids()]
    )
    return "run-" + hashlib.sha256(text.encode()).hexdigest()[:16]


def _parse_layout(raw: bytes, key: str) -> dict[str, Any]:
    try:
        layout = json.loads(raw)
    except ValueError as e:
        raise SnapshotError(f"share layout of {key!r} is not JSON: {e}") from None
    if isinstance(layout, dict) and layout.get("layout") != _LAYOUT_KIND:
        raise SnapshotError(
            f"the shares of {key!r} were laid out by another version of lightning-snapshot"
            f" (layout {layout.get('layout', 'striped')!r}, this one reads {_LAYOUT_KIND!r}); restore"
            " from a durable tier, or with the version that wrote them"
        )
    ints = ("k", "m", "nbytes", "block", "stripes")
    if (
        not isinstance(layout, dict)
        or any(not isinstance(layout.get(f), int) or layout[f] < 0 for f in ints)
        or layout["k"] < 1
        or not isinstance(layout.get("checksums"), list)
        or len(layout["checksums"]) != layout["k"] + layout["m"]
        or not all(isinstance(c, str) for c in layout["checksums"])
        or layout["stripes"] * layout["block"] * layout["k"] < layout["nbytes"]
    ):
        raise SnapshotError(f"share layout of {key!r} is malformed; delete the RAM tier's memory for this run")
    return layout


def _layout_of(meta: dict[str, Any]) -> _ec.ShareLayout:
    return _ec.ShareLayout(meta["k"], meta["m"], meta["nbytes"], meta["block"], meta["stripes"])


def _data_share_nbytes(lay: _ec.ShareLayout, i: int) -> int:
    """Bytes of the object in data share ``i`` (the rest of the share is zeros)."""
    return max(0, min(lay.share_nbytes, lay.nbytes - i * lay.share_nbytes))


def _data_share(data: memoryview, lay: _ec.ShareLayout, i: int) -> tuple[memoryview, int]:
    """Data share ``i`` of the object ``data``: its bytes of the object (a view) and the zeros that follow."""
    have = _data_share_nbytes(lay, i)
    at = min(i * lay.share_nbytes, lay.nbytes)
    return data[at : at + have], lay.share_nbytes - have


_ZEROS = memoryview(bytes(1 << 20))


def _padded_digest(item: tuple[memoryview, int]) -> str:
    """xxh3 of ``view`` followed by ``pad`` zero bytes (what :func:`digest` gives for the padded bytes)."""
    view, pad = item
    if not pad:
        return digest(view)
    h = xxhash.xxh3_64()
    h.update(view)
    while pad:
        n = min(pad, _ZEROS.nbytes)
        h.update(_ZEROS[:n])
        pad -= n
    return h.hexdigest()


def _digests(items: list[tuple[memoryview, int]], threads: int | None) -> list[str]:
    """xxh3 of each (view + that many zero bytes) of ``items``, on several threads (xxh3 releases the GIL)."""
    workers = min(len(items), threads or min(8, os.cpu_count() or 1))
    if workers <= 1:
        return [_padded_digest(v) for v in items]
    with cf.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="lightning-snapshot-digest") as pool:
        return list(pool.map(_padded_digest, items))


#: Bytes a share is hashed in (read into a buffer that stays in the L2 cache).
_HASH_PIECE = 1 << 20


def _file_digest(path: Path, size: int) -> str | None:
    """The xxh3 of the file at ``path`` if it has ``size`` bytes, else None. Read piece by piece into a small buffer
    (cheaper than mapping a fresh file, whose every page would fault); the GIL is released while it reads and
    hashes."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        if os.fstat(fd).st_size != size:
            return None
        if size < _HASH_PIECE:
            return digest(memoryview(os.pread(fd, size, 0)))
        h = xxhash.xxh3_64()
        buf = memoryview(bytearray(_HASH_PIECE))
        pos = 0
        while pos < size:
            n = os.preadv(fd, [buf[: min(_HASH_PIECE, size - pos)]], pos)
            if n == 0:
                return None
            h.update(buf[:n])
            pos += n
        return h.hexdigest()
    finally:
        os.close(fd)


def _share_ok(path: Path, size: int, checksum: str, verify: bool) -> bool:
    """Whether the share file at ``path`` can be used: ``size`` bytes and, with ``verify``, the xxh3 ``checksum``
    (without, it is trusted until a chunk read from it fails its checksum: see :meth:`RamTier.restore`)."""
    if verify:
        return _file_digest(path, size) == checksum
    try:
        return os.stat(path).st_size == size
    except OSError:
        return False


def _read_exactly(fd: int, view: memoryview, pos: int, key: str) -> None:
    if _pread_all(fd, view, pos) < view.nbytes:
        raise EOFError(f"{key!r}: a file of the RAM tier ends before byte {pos + view.nbytes}")


def _view(mm: mmap.mmap | None) -> memoryview:
    return memoryview(mm) if mm is not None else memoryview(bytearray(0))
