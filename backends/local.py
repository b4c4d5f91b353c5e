"""Local (NVMe) tier: snapshots as files under a directory."""

from __future__ import annotations

import ctypes
import datetime as _dt
import errno
import logging
import mmap
import os
import shutil
import threading
from collections.abc import Iterable
from pathlib import Path

from lightning_snapshot.backends.base import DEFAULT_KEEP_LAST, Backend
from lightning_snapshot.errors import (
    ConfigError,
    SnapshotNotFoundError,
    SnapshotWriteError,
    StorageFullError,
    UnsafePathError,
)
from lightning_snapshot.manifest import validate_key

__all__ = ["LocalTier"]

log = logging.getLogger(__name__)

_PAGE = 4096
_IO_CHUNK = 64 << 20


def _aligned(view: memoryview) -> bool:
    if view.readonly or view.nbytes == 0:
        return False
    return ctypes.addressof(ctypes.c_char.from_buffer(view)) % _PAGE == 0


def _pread_all(fd: int, view: memoryview, offset: int) -> int:
    """Fill ``view`` from ``fd`` at ``offset`` (the GIL is released while the kernel copies); returns the bytes
    read, fewer than ``view`` holds only where the file ends first."""
    pos = offset
    while view.nbytes:
        n = os.preadv(fd, [view[:_IO_CHUNK]], pos)
        if not n:
            break
        pos += n
        view = view[n:]
    return pos - offset


def _pwrite_all(fd: int, view: memoryview, offset: int) -> None:
    while view.nbytes:
        n = os.pwrite(fd, view[:_IO_CHUNK], offset)
        offset += n
        view = view[n:]


class LocalTier(Backend):
    """Snapshots as files on a local filesystem (node-local NVMe, or any POSIX path).

    Commit rule: data objects are written and fsynced first; the manifest is written to a temporary file, fsynced
    and moved into place with ``os.replace``, then the directory is fsynced. A step without a manifest does not
    exist for the loader.

    Args:
        path: the tier's root directory (created if missing). ``~`` is expanded.
        every_n_train_steps, train_time_interval, keep_last: see :class:`~lightning_snapshot.backends.base.Backend`.

    URL form: ``"/path?every=100&keep=3&interval=600"`` or ``"file:///path?..."``.
    """

    tier = "local"
    durable = True
    #: Permissions of the files the tier creates.
    file_mode = 0o644
    parallel_reads = 4
    check_hint = ("Choose a path that is (or can be created as) a directory this process may write: check the"
                  " permissions, that no part of the path is a file, and that the filesystem is mounted read-write")

    def __init__(
        self,
        path: str | os.PathLike[str],
        every_n_train_steps: int | None = None,
        train_time_interval: _dt.timedelta | float | None = None,
        keep_last: int | None = DEFAULT_KEEP_LAST,
    ) -> None:
        super().__init__(
            every_n_train_steps=every_n_train_steps, train_time_interval=train_time_interval, keep_last=keep_last
        )
        if not isinstance(path, (str, os.PathLike)) or not os.fspath(path):
            raise ConfigError(f"LocalTier path must be a non-empty path, got {path!r}")
        self.root = Path(os.path.expanduser(os.fspath(path))).absolute()
        #: Write page-aligned buffers with O_DIRECT (turned off by itself where the filesystem refuses it).
        self.direct_io = hasattr(os, "O_DIRECT")
        self._init_process_state()
        if self.root.exists() and not self.root.is_dir():
            raise ConfigError(f"LocalTier path {str(self.root)!r} exists and is not a directory: choose another path")

    _process_local = ("direct_bytes", "bytes_read", "_count_lock")

    def _init_process_state(self) -> None:
        super()._init_process_state()
        #: Bytes written with O_DIRECT so far in this process (a counter for tests and benchmarks).
        self.direct_bytes = 0
        #: Bytes read with ranged reads in this process (``read_into``; a counter: resharding reads only what each
        #: rank needs).
        self.bytes_read = 0
        self._count_lock = threading.Lock()

    @property
    def url(self) -> str:
        return str(self.root)

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

    @staticmethod
    def _fsync_dir(path: Path) -> None:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    # ------------------------------------------------------------------------------------------- bytes
    def write(self, key: str, buffers: Iterable[bytes | bytearray | memoryview]) -> int:
        """Write ``buffers`` to ``key`` and fsync.

        Page-aligned buffers (the staging arena) are written with ``O_DIRECT``, which skips the page cache and the
        CPU copy into it; the unaligned tail, other buffers, and filesystems that refuse ``O_DIRECT`` (tmpfs) use
        ordinary writes.
        """
        path = self._path(key)
        total = 0
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, self.file_mode)
            direct_fd = -1
            try:
                for buf in buffers:
                    view = memoryview(buf).cast("B")
                    if self.direct_io and direct_fd < 0 and view.nbytes >= _PAGE and _aligned(view):
                        direct_fd = self._open_direct(path)
                    if direct_fd >= 0 and total % _PAGE == 0 and _aligned(view):
                        n = view.nbytes & ~(_PAGE - 1)
                        try:
                            _pwrite_all(direct_fd, view[:n], total)
                            self.direct_bytes += n
                            total += n
                            view = view[n:]
                        except OSError as e:
                            if e.errno != errno.EINVAL:
                                raise
                            os.close(direct_fd)
                            direct_fd, self.direct_io = -1, False
                    _pwrite_all(fd, view, total)
                    total += view.nbytes
                os.fsync(fd)
            finally:
                os.close(fd)
                if direct_fd >= 0:
                    os.close(direct_fd)
        except OSError as e:
            try:
                path.unlink()
            except OSError:
                pass
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
        path = self._path(key)
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, self.file_mode)
            try:
                view = memoryview(data)
                while view.nbytes:
                    view = view[os.write(fd, view):]
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, path)
            self._fsync_dir(path.parent)
        except OSError as e:
            try:
                tmp.unlink()
            except OSError:
                pass
            raise self._fail(key, e, len(data)) from e

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
            if _pread_all(fd, view, offset) < total:
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
            try:
                path.unlink()
            except FileNotFoundError:
                pass

    def exists(self, key: str) -> bool:
        return self._path(key).is_file()

    def require_exists(self) -> None:
        if not self.root.is_dir():
            raise SnapshotNotFoundError(
                f"no snapshot tier at {str(self.root)!r}: the directory does not exist. Check the path (a tier root"
                " holds step-* directories)"
            )
