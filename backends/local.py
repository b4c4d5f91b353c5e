"""Local (NVMe) tier: snapshots as files under a directory.

:class:`LocalTier` is made by registry.py (a path or ``file://`` URL) or by the user, and driven through the
:class:`~lightning_snapshot.backends.base.Backend` interface by the engine (writer.py, persist.py, restore.py,
loader.py) and by the RAM tier's agent; the RAM tier (ram/tier.py, ram/rebuild.py) also uses it as a node's store.
"""

from __future__ import annotations

import contextlib
import ctypes
import datetime as _dt
import errno
import logging
import mmap
import os
import re
import shutil
import threading
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, TypeVar

from lightning_snapshot.backends.base import DEFAULT_KEEP_LAST, Backend, node_steps
from lightning_snapshot.backends.mapped_files import (
    close_map,
    create_file,
    exchange,
    map_existing,
    map_new,
    pread_all,
    pwrite_all,
)
from lightning_snapshot.comm import agree_on
from lightning_snapshot.errors import (
    ConfigError,
    SnapshotError,
    SnapshotNotFoundError,
    SnapshotWriteError,
    StorageFullError,
    UnsafePathError,
)
from lightning_snapshot.manifest import validate_key

__all__ = ["NODE_RANK_PLACEHOLDER", "LocalTier", "dir_mode_for", "parse_mode"]

log = logging.getLogger(__name__)

_T = TypeVar("_T")
#: The placeholder a path may hold for the node's rank (``/nvme/snap/run-42`` on every node, or
#: ``/shared/snap/node{node_rank}`` to give each node its own directory, e.g. in a one-machine simulation).
NODE_RANK_PLACEHOLDER = "{node_rank}"

_PAGE = 4096


def _aligned(view: memoryview) -> bool:
    if view.readonly or view.nbytes == 0:
        return False
    return ctypes.addressof(ctypes.c_char.from_buffer(view)) % _PAGE == 0


def parse_mode(value: object, where: str = "LocalTier mode") -> int | None:
    """The permissions ``value`` names: None, an int or an octal string (``"0600"``, ``"0o600"``), between 0o600 and
    0o777 with read and write for the owner (the tier reads and rewrites its own files).

    Raises:
        ConfigError: naming ``where`` and the accepted form.
    """
    if value is None:
        return None
    mode: int | None = None
    if isinstance(value, int) and not isinstance(value, bool):
        mode = value
    elif isinstance(value, str) and re.fullmatch(r"(0o?)?[0-7]{3}", value.strip().lower()):
        mode = int(value.strip().lower().replace("0o", "", 1), 8)
    if mode is None or not 0 <= mode <= 0o777 or mode & 0o600 != 0o600:
        raise ConfigError(
            f"{where} must be file permissions in octal that give the owner read and write, from 0o600 to 0o777,"
            f" e.g. mode=0o600 (URL: ?mode=0600) for files only the owner can read; got"
            f" {oct(value) if isinstance(value, int) and not isinstance(value, bool) else repr(value)}"
        )
    return mode


def dir_mode_for(mode: int) -> int:
    """The directory permissions matching the file permissions ``mode``: search (x) wherever read is allowed."""
    return mode | (mode & 0o444) >> 2


def _needed_objects(manifest: Any, world_size: int) -> set[str]:
    """The objects a restore into ``world_size`` ranks reads: those of the shared tensors, and those of the rank
    sections it restores (every rank's at the same world size; at another, rank 0's, for the data position)."""
    ranks = range(world_size) if manifest.world_size == world_size else [0]
    entries = list(manifest.tensors)
    for r in ranks:
        section = manifest.rank_section(r)
        if section is not None:
            entries += section.tensors
    return {f.object for t in entries for f in t.fragments}


class LocalTier(Backend):
    """Snapshots as files on a local filesystem (node-local NVMe, or any POSIX path).

    Commit rule: data objects are written and fsynced first; the manifest is written to a temporary file, fsynced
    and moved into place with ``os.replace``, then the directory is fsynced. A step without a manifest does not
    exist for the loader.

    In a multi-node job the directory may be shared by all nodes (a network filesystem) or *node-local* (each node's
    own disk). Node-local: every node holds its own ranks' data objects and a copy of the manifest; the commit is
    agreed over the process group (every rank's data written, then every node commits the same manifest), and a
    restore fetches the objects a node lacks from the nodes that hold them, over the process group (see
    :meth:`restore`). Which one it is, is detected when training starts (each node writes a probe file and the ranks
    compare what they see) unless ``node_local`` says so.

    Args:
        path: the tier's root directory (created if missing). ``~`` is expanded; ``{node_rank}`` is replaced by the
            node's rank (each node its own directory: node-local; ``NODE_RANK`` or 0 until training binds it).
        every_n_train_steps, train_time_interval, keep_last, min_every, max_every: see
            :class:`~lightning_snapshot.backends.base.Backend`.
        node_local: ``None`` (default): detect at the start of training; ``True``: each node has its own directory;
            ``False``: one directory shared by all nodes.
        mode: permissions of the files the tier creates, exactly (e.g. ``0o600``: only the owner can read them);
            the directories it creates get the matching search bits (``0o700``). ``None`` (default): files
            ``0o666`` and directories ``0o777`` less the process umask, as ``torch.save`` and ``open`` do (umask
            022: 0644 and 0755). The snapshot agent, writing in the trainer's place, keeps the same mode.

    URL form: ``"/path?every=100&keep=3&interval=600&node_local=auto&mode=0600"`` or ``"file:///path?..."``
    (``node_local`` is ``auto``, ``true`` or ``false``; ``mode`` is octal, ``0600`` to ``0777``).
    """

    tier = "local"
    copy_source = True
    durable = True
    root: Path  # (the declared capabilities this tier always has, with their types here)
    bytes_read: int
    #: Permissions of the files the tier creates, less the umask, unless ``mode`` is given.
    file_mode = 0o666
    parallel_reads = 4
    check_hint = (
        "Choose a path that is (or can be created as) a directory this process may write: check the"
        " permissions, that no part of the path is a file, and that the filesystem is mounted read-write"
    )

    def __init__(
        self,
        path: str | os.PathLike[str],
        every_n_train_steps: int | str | None = None,
        train_time_interval: _dt.timedelta | float | None = None,
        keep_last: int | None = DEFAULT_KEEP_LAST,
        *,
        min_every: int | None = None,
        max_every: int | None = None,
        node_local: bool | None = None,
        mode: int | str | None = None,
    ) -> None:
        super().__init__(
            every_n_train_steps=every_n_train_steps,
            train_time_interval=train_time_interval,
            keep_last=keep_last,
            min_every=min_every,
            max_every=max_every,
        )
        if not isinstance(path, (str, os.PathLike)) or not os.fspath(path):
            raise ConfigError(f"LocalTier path must be a non-empty path, got {path!r}")
        if node_local is not None and not isinstance(node_local, bool):
            raise ConfigError(f"LocalTier node_local must be True, False or None (detect), got {node_local!r}")
        #: Exact permissions of the files the tier creates (None: ``file_mode`` less the umask).
        self.mode = parse_mode(mode)
        self.path_template = os.path.expanduser(os.fspath(path))
        if NODE_RANK_PLACEHOLDER in self.path_template and node_local is False:
            raise ConfigError(
                f"LocalTier path {self.path_template!r} gives each node its own directory"
                f" ({NODE_RANK_PLACEHOLDER}), so it cannot be node_local=False: drop one of the two"
            )
        #: The user's choice (None: detect at set-up).
        self.node_local_option = node_local
        #: Whether each node has its own directory (settled by :meth:`settle_layout` in a multi-node job).
        self.node_local = bool(node_local)
        self.node_rank, self.num_nodes, self.local_rank, self.ranks_per_node = 0, 1, 0, 1
        self.root = self._resolve(os.environ.get("NODE_RANK", "0"))
        #: Write page-aligned buffers with O_DIRECT (turned off by itself where the filesystem refuses it).
        self.direct_io = hasattr(os, "O_DIRECT")
        self._init_process_state()
        if self.root.exists() and not self.root.is_dir():
            raise ConfigError(f"LocalTier path {str(self.root)!r} exists and is not a directory: choose another path")

    _process_local = ("direct_bytes", "bytes_read", "_count_lock", "_fetched")

    def _init_process_state(self) -> None:
        super()._init_process_state()
        #: Bytes written with O_DIRECT so far in this process (a counter for tests and benchmarks).
        self.direct_bytes = 0
        #: Bytes read with ranged reads in this process (``read_into``; a counter: resharding reads only what each
        #: rank needs).
        self.bytes_read = 0
        self._count_lock = threading.Lock()
        #: Files a node-local restore fetched from other nodes (deleted by :meth:`finish_restore`).
        self._fetched: list[Path] = []

    @property
    def url(self) -> str:
        return str(self.root)

    def _resolve(self, node_rank: object) -> Path:
        return Path(self.path_template.replace(NODE_RANK_PLACEHOLDER, str(node_rank))).absolute()

    # ------------------------------------------------------------------------------------------- multi-node
    def bind(self, *, node_rank: int, num_nodes: int, local_rank: int, ranks_per_node: int) -> None:
        """Place this tier in the job (called by the callback at set-up, on every rank)."""
        self.node_rank, self.num_nodes = node_rank, num_nodes
        self.local_rank, self.ranks_per_node = local_rank, ranks_per_node
        self.root = self._resolve(node_rank)
        if self.root.exists() and not self.root.is_dir():
            raise ConfigError(f"LocalTier path {str(self.root)!r} exists and is not a directory: choose another path")

    @property
    def node_leader(self) -> bool:
        """Whether this rank writes what its node holds once (the manifest copy, retention): node-local only."""
        return self.node_local and self.local_rank == 0

    def settle_layout(self, comm: Any, run_id: str) -> str:
        """Decide whether the directory is shared by all nodes or node-local (collective: every rank calls it).

        Unless ``node_local`` was given: the first rank of each node writes a probe file, every rank lists the probe
        files it sees, and the ranks compare over ``comm``: all see every node's probe -> shared; each sees its own
        node's only -> node-local; anything else is an error (set ``node_local``). Returns how it was settled.

        Raises:
            ConfigError: on every rank together, when the ranks see inconsistent probes or cannot write one.
        """
        if self.num_nodes <= 1 and self.node_local_option is None:
            self.node_local = False
            return "one node"
        if self.node_local_option is not None or NODE_RANK_PLACEHOLDER in self.path_template:
            self.node_local = self.node_local_option is not False
            return "set" if self.node_local_option is not None else f"{NODE_RANK_PLACEHOLDER} in the path"
        probe = self.root / f".probe-{run_id}-node{self.node_rank:05d}"
        error = ""
        if self.local_rank == 0:
            try:
                self._mkdirs(self.root)
                probe.write_bytes(b"")
            except OSError as e:
                error = f"cannot write {str(probe)!r}: {e}"
        comm.barrier()
        try:
            seen = sorted(n for n in os.listdir(self.root) if n.startswith(f".probe-{run_id}-node"))
        except OSError as e:
            seen, error = [], error or f"cannot list {str(self.root)!r}: {e}"
        agreed = agree_on(comm, f"probing the local tier {self.url}", lambda: seen, error=error or None, gather=True)
        comm.barrier()
        if self.local_rank == 0:
            with contextlib.suppress(OSError):
                probe.unlink()
        if not agreed.ok:
            raise ConfigError(f"cannot tell whether the local tier {self.url} is shared or node-local: {agreed.text}")
        counts = {len(s or []) for s in agreed.values or []}
        if counts == {self.num_nodes}:
            self.node_local = False
        elif counts == {1}:
            self.node_local = True
        else:
            raise ConfigError(
                f"the local tier {self.url}: the ranks see the probe files of different sets of nodes"
                f" ({sorted(counts)} of {self.num_nodes}); is the directory shared by some nodes only? Pass"
                " LocalTier(..., node_local=True) or node_local=False (URL: ?node_local=true|false)"
            )
        return "detected"

    def collective_steps(self, comm: Any) -> list[int]:
        """Steps whose manifest any node holds, newest first (collective; node-local tiers: see
        :func:`~lightning_snapshot.backends.base.node_steps`)."""
        return node_steps(self, comm)

    def restore(self, comm: Any, step: int, read: Callable[[], _T]) -> _T:
        """Restore ``step`` (collective): node-local, first make every object of it readable on this node
        (:meth:`prepare_restore`), then ``read()``, then free what was fetched. Shared: ``read()``."""
        if not self.node_local:
            return read()
        try:
            self.prepare_restore(comm, step)
            return read()
        finally:
            self.finish_restore()

    def prepare_restore(self, comm: Any, step: int) -> None:
        """Make every object of ``step`` readable on this node (collective; node-local tiers).

        The first rank of each node says what its node holds; objects a node lacks (the other nodes' ranks' data,
        needed because every rank writes a share of the replicated state, and after a change of world size) are sent
        to it over ``comm`` (gloo) from the lowest node that holds them, and the manifest too where it lacks one.

        Raises:
            SnapshotError: on every rank together, when some object is on no node of the job (a replaced node with
                an empty disk, or a lost one): naming the nodes that lack the step.
        """
        from lightning_snapshot.manifest import MANIFEST_NAME, Manifest, step_dirname

        prefix = step_dirname(step)
        world = getattr(comm, "world_size", 1)
        inv: dict[str, Any] | None = None
        if self.node_leader:
            inv = {"node": self.node_rank, "manifest": self.exists(f"{prefix}/{MANIFEST_NAME}"), "objects": {}}
            for name in self.list(prefix):
                if name.endswith(".bin"):
                    inv["objects"][name] = self._path(f"{prefix}/{name}").stat().st_size
        gathered: list[dict[str, Any] | None] = comm.all_gather(inv) if world > 1 else [inv]
        invs = {r: i for r, i in enumerate(gathered) if i is not None}  # the node leaders' inventories
        leaders = list(invs)
        holders = [r for r in leaders if invs[r]["manifest"]]
        if not holders:
            raise SnapshotNotFoundError(f"no node holds the manifest of step {step} in the local tier {self.url}")
        text = self._broadcast_from(
            comm, holders[0], self.read(f"{prefix}/{MANIFEST_NAME}").decode() if comm.rank == holders[0] else None
        )
        manifest = Manifest.from_json(text, where=f"manifest of {prefix} in the local tier {self.url}")
        needed = _needed_objects(manifest, world)
        where: dict[str, list[int]] = {}
        for o in manifest.objects:
            where[o.key] = [r for r in leaders if invs[r]["objects"].get(o.key) == o.nbytes]
        lost = sorted({o.rank for o in manifest.objects if o.key in needed and not where[o.key]})
        if lost:
            lacking = sorted(invs[r]["node"] for r in leaders if not invs[r]["manifest"]) or sorted(
                invs[r]["node"] for r in leaders
            )
            raise SnapshotError(
                f"node(s) {', '.join(map(str, lacking))} of this job do not hold step {step} of the node-local tier"
                f" {self.url}, and the data of rank(s) {', '.join(map(str, lost))} is on no node (a replaced node with"
                " an empty disk, or a lost one)"
            )
        transfers = [
            (where[o.key][0], dst, o.key, o.nbytes)
            for dst in leaders
            for o in manifest.objects
            if o.key in needed and dst not in where[o.key]
        ]
        self._fetched = []
        if comm.rank in leaders:
            self._transfer(comm, [t for t in transfers if comm.rank in t[:2]], prefix)
            if not invs[comm.rank]["manifest"]:
                self.commit(f"{prefix}/{MANIFEST_NAME}", text.encode())
                self._fetched.append(self._path(f"{prefix}/{MANIFEST_NAME}"))
        if transfers:
            log.info(
                "lightning-snapshot: local tier %s: fetched %d object(s) of step %d from other nodes",
                self.url,
                len([t for t in transfers if t[1] == comm.rank]),
                step,
            )
        if world > 1:
            comm.barrier()

    @staticmethod
    def _broadcast_from(comm: Any, src: int, obj: Any) -> Any:
        if getattr(comm, "world_size", 1) == 1:
            return obj
        import torch.distributed as dist

        box = [obj]
        dist.broadcast_object_list(box, src=dist.get_global_rank(comm.group, src), group=comm.group)
        return box[0]

    def _transfer(self, comm: Any, transfers: list[tuple[int, int, str, int]], prefix: str) -> None:
        """Send and receive this rank's part of ``transfers`` ((src, dst, object key, bytes)) over gloo; a received
        object lands under a temporary name and is renamed into place once complete."""
        if not transfers:
            return
        import torch.distributed as dist

        sends, receives, received = [], [], []
        try:
            for src, dst, key, nbytes in transfers:
                path = self._path(f"{prefix}/{key}")
                if comm.rank == src:
                    sends.append((map_existing(path, write=False), dist.get_global_rank(comm.group, dst)))
                else:
                    tmp = path.with_name(f".{path.name}.fetch-{os.getpid()}")
                    self._mkdirs(path.parent)
                    received.append((tmp, path))
                    receives.append(
                        (map_new(tmp, nbytes, self.mode, self.file_mode), dist.get_global_rank(comm.group, src))
                    )
        except BaseException:
            for mm, _peer in sends + receives:
                close_map(mm)
            raise
        exchange(comm.group, sends, receives)
        for tmp, path in received:
            os.replace(tmp, path)
            self._fetched.append(path)

    def finish_restore(self) -> None:
        """Delete what :meth:`prepare_restore` fetched: each node keeps only its own ranks' objects."""
        fetched, self._fetched = self._fetched, []
        for path in fetched:
            with contextlib.suppress(OSError):
                path.unlink()
        for parent in {p.parent for p in fetched}:
            with contextlib.suppress(OSError):
                parent.rmdir()  # (only if empty: a step this node did not hold)

    # ------------------------------------------------------------------------------------------- paths
    def _path(self, key: str, *, allow_root: bool = False) -> Path:
        if allow_root and key == "":
            return self.root
        validate_key(key)
        path = self.root / key
        # a symlink inside the tier must not lead out of it
        real_root = os.path.realpath(self.root)
        real = os.path.realpath(path)
        if real != real_root and not real.startswith(real_root + os.sep):
            raise UnsafePathError(
                f"{key!r} resolves to {real!r}, outside the tier root {real_root!r} (a symlink?). Remove the link"
                " or use another snapshot"
            )
        return path

    def _fail(self, key: str, e: OSError, nbytes: int | None = None) -> SnapshotWriteError:
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            need = f" (after {nbytes} bytes)" if nbytes is not None else ""
            return StorageFullError(
                e.errno,
                f"no space left on device while writing {key!r}{need} to the local tier {str(self.root)!r}:"
                " free disk space, lower keep_last or snapshot less often. Earlier snapshots are intact",
            )
        return SnapshotWriteError(e.errno, f"writing {key!r} to the local tier {str(self.root)!r} failed: {e}")

    def _mkdirs(self, path: Path) -> None:
        """Create ``path`` and its missing parents: with ``mode``'s directory permissions exactly when given, else
        under the umask. Directories that exist are left as they are."""
        if self.mode is None:
            path.mkdir(parents=True, exist_ok=True)
            return
        missing = []
        while not path.is_dir():
            missing.append(path)
            if path.parent == path:
                break
            path = path.parent
        dmode = dir_mode_for(self.mode)
        for d in reversed(missing):
            try:
                os.mkdir(d, dmode)
            except FileExistsError:
                if d.is_dir():
                    continue  # (another rank made it)
                raise
            os.chmod(d, dmode)  # (exactly, whatever the umask)

    @staticmethod
    def _fsync_dir(path: Path) -> None:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    # ------------------------------------------------------------------------------------------- bytes
    def write(self, key: str, buffers: Iterable[bytes | bytearray | memoryview]) -> int:
        """Write ``buffers`` to ``key``, fsync, and publish it whole: the bytes go to a hidden temporary file beside
        ``key`` (its name starts with a dot, so it is never listed) that is renamed to ``key`` once complete and
        fsynced, so another process never sees the object empty or in part.

        Page-aligned buffers (the staging arena) are written with ``O_DIRECT``, which skips the page cache and the
        CPU copy into it; the unaligned tail, other buffers, and filesystems that refuse ``O_DIRECT`` (tmpfs) use
        ordinary writes.
        """
        path = self._path(key)
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{threading.get_ident()}")
        total = 0
        try:
            self._mkdirs(path.parent)
            fd = create_file(tmp, os.O_WRONLY | os.O_TRUNC, self.mode, self.file_mode)
            direct_fd = -1
            try:
                for buf in buffers:
                    view = memoryview(buf).cast("B")
                    if self.direct_io and direct_fd < 0 and view.nbytes >= _PAGE and _aligned(view):
                        direct_fd = self._open_direct(tmp)
                    if direct_fd >= 0 and total % _PAGE == 0 and _aligned(view):
                        n = view.nbytes & ~(_PAGE - 1)
                        try:
                            pwrite_all(direct_fd, view[:n], total)
                            self.direct_bytes += n
                            total += n
                            view = view[n:]
                        except OSError as e:
                            if e.errno != errno.EINVAL:
                                raise
                            os.close(direct_fd)
                            direct_fd, self.direct_io = -1, False
                    pwrite_all(fd, view, total)
                    total += view.nbytes
                os.fsync(fd)
            finally:
                os.close(fd)
                if direct_fd >= 0:
                    os.close(direct_fd)
            os.replace(tmp, path)
            self._fsync_dir(path.parent)
        except OSError as e:
            with contextlib.suppress(OSError):
                tmp.unlink()
            raise self._fail(key, e, total) from e
        return total

    def _open_direct(self, path: Path) -> int:
        try:
            return os.open(path, os.O_WRONLY | os.O_CLOEXEC | getattr(os, "O_DIRECT", 0))
        except OSError as e:
            if e.errno not in (errno.EINVAL, errno.EOPNOTSUPP):
                raise
            log.info("lightning-snapshot: %s refuses O_DIRECT (%s); using buffered writes", self.root, e)
            self.direct_io = False
            return -1

    def commit(self, key: str, data: bytes) -> None:
        """Publish ``key`` atomically and durably: :meth:`write` already writes to a temporary name, fsyncs, renames
        into place and fsyncs the directory, which is this tier's commit rule."""
        self.write(key, [data])

    def read(self, key: str) -> bytes:
        return self._path(key).read_bytes()

    def read_view(self, key: str) -> memoryview:
        """The object mapped read-only into memory (no copy; pages come from the page cache or the disk)."""
        with open(self._path(key), "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size == 0:
                return memoryview(b"")
            return memoryview(mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ))

    def read_into(self, key: str, offset: int, out: memoryview) -> None:
        """Thread-safe; ``preadv`` straight into ``out`` (the GIL is released while the kernel copies)."""
        view = memoryview(out).cast("B")
        total = view.nbytes
        fd = os.open(self._path(key), os.O_RDONLY | os.O_CLOEXEC)
        try:
            if pread_all(fd, view, offset) < total:
                raise EOFError(f"{key!r} in {str(self.root)!r} ends before byte {offset + total}")
        finally:
            os.close(fd)
        with self._count_lock:
            self.bytes_read += total

    def list(self, prefix: str = "") -> list[str]:
        """Raises ``OSError`` when the tier's root exists and cannot be listed (not a directory, no permission);
        a root or prefix that does not exist lists as empty."""
        path = self._path(prefix, allow_root=True)
        try:
            return sorted(p.name for p in path.iterdir() if not p.name.startswith("."))
        except FileNotFoundError:
            return []
        except NotADirectoryError:
            if path == self.root:
                raise
            return []

    def delete(self, key: str) -> None:
        path = self._path(key)
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            with contextlib.suppress(FileNotFoundError):
                path.unlink()

    def exists(self, key: str) -> bool:
        return self._path(key).is_file()

    def modified(self, key: str) -> float | None:
        """The newest ``st_mtime`` of ``key`` and of every file and directory under it (hidden ones included: a
        manifest being committed is a hidden temporary file); a file being written changes it with every write."""
        path = self._path(key)
        newest: float | None = None
        try:
            newest = path.lstat().st_mtime
            if path.is_dir() and not path.is_symlink():
                for base, dirs, files in os.walk(path):
                    for name in dirs + files:
                        try:
                            newest = max(newest, os.lstat(os.path.join(base, name)).st_mtime)
                        except FileNotFoundError:  # removed meanwhile
                            continue
        except FileNotFoundError:
            return None
        return newest

    def require_exists(self) -> None:
        if not self.root.is_dir():
            raise SnapshotNotFoundError(
                f"no snapshot tier at {str(self.root)!r}: the directory does not exist. Check the path (a tier root"
                " holds step-* directories)"
            )
