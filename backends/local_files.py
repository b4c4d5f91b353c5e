"""The local tier's files: paths under the root (no symlink out of it), writes (``O_DIRECT`` where it can, a hidden
temporary file renamed into place, fsynced), ranged reads, listing, deletion; the permissions of what it creates.

:class:`LocalFiles` is a part that :class:`~lightning_snapshot.backends.local.LocalTier` holds (its ``files``) and
delegates its bytes to; the RAM tier reaches its node's files through its node store's ``files`` too. It knows no job
(that is :mod:`~lightning_snapshot.backends.local_layout`) and no snapshot format beyond the keys' rules.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import logging
import mmap
import os
import re
import shutil
import threading
from collections.abc import Iterable
from pathlib import Path

from lightning_snapshot.backends.mapped_files import create_file, pread_all, pwrite_all
from lightning_snapshot.errors import (
    ConfigError,
    SnapshotNotFoundError,
    SnapshotWriteError,
    StorageFullError,
    UnsafePathError,
)
from lightning_snapshot.format.manifest import validate_key

__all__ = ["LocalFiles", "dir_mode_for", "parse_mode"]

log = logging.getLogger(__name__)

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


class LocalFiles:
    """The files under :attr:`root`: every path checked to stay in it, the bytes written whole and durably.

    Thread-safe where :class:`~lightning_snapshot.backends.base.Backend` says its methods are (``read_into`` from
    several threads: :meth:`count_read` counts under a lock).

    Args:
        root: the directory (the layout moves it when the job places the tier: :meth:`move_to`).
        mode: exact permissions of the files created (None: ``file_mode`` less the umask).
        file_mode: permissions of the files created, less the umask, when ``mode`` is None.
        direct_io: write page-aligned buffers with ``O_DIRECT`` (turned off by itself where the filesystem refuses).
        where: how errors name the tier ("the local tier").
    """

    def __init__(
        self, root: Path, *, mode: int | None, file_mode: int, direct_io: bool, where: str = "the local tier"
    ) -> None:
        self.root = root
        #: Exact permissions of the files created (None: ``file_mode`` less the umask).
        self.mode = mode
        self.file_mode = file_mode
        #: Write page-aligned buffers with O_DIRECT (turned off by itself where the filesystem refuses it).
        self.direct_io = direct_io
        self.where = where
        self.init_process_state()

    # ------------------------------------------------------------------------------------------- process state
    def init_process_state(self) -> None:
        """This process's counters and lock (made again where the files were unpickled)."""
        #: Bytes written with O_DIRECT so far in this process (a counter for tests and benchmarks).
        self.direct_bytes = 0
        #: Bytes read with ranged reads in this process (``read_into``; a counter: resharding reads only what each
        #: rank needs).
        self.bytes_read = 0
        #: Guards :attr:`bytes_read` (``read_into`` runs on several threads).
        self.count_lock = threading.Lock()

    def __getstate__(self) -> dict[str, object]:
        state = dict(self.__dict__)
        for name in ("direct_bytes", "bytes_read", "count_lock"):
            state.pop(name, None)
        return state

    def __setstate__(self, state: dict[str, object]) -> None:
        self.__dict__.update(state)
        self.init_process_state()

    def move_to(self, root: Path) -> None:
        """Use ``root`` from now on (the layout placed the tier on its node)."""
        self.root = root

    def count_read(self, nbytes: int) -> None:
        """Add ``nbytes`` to :attr:`bytes_read` (thread-safe; also for reads made by the RAM tier from its shares)."""
        with self.count_lock:
            self.bytes_read += nbytes

    # ------------------------------------------------------------------------------------------- paths
    def path(self, key: str, *, allow_root: bool = False) -> Path:
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

    def fail(self, key: str, e: OSError, nbytes: int | None = None) -> SnapshotWriteError:
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            need = f" (after {nbytes} bytes)" if nbytes is not None else ""
            return StorageFullError(
                e.errno,
                f"no space left on device while writing {key!r}{need} to {self.where} {str(self.root)!r}:"
                " free disk space, lower keep_last or snapshot less often. Earlier snapshots are intact",
            )
        return SnapshotWriteError(e.errno, f"writing {key!r} to {self.where} {str(self.root)!r} failed: {e}")

    def mkdirs(self, path: Path) -> None:
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
    def fsync_dir(path: Path) -> None:
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
        path = self.path(key)
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{threading.get_ident()}")
        total = 0
        try:
            self.mkdirs(path.parent)
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
            self.fsync_dir(path.parent)
        except OSError as e:
            with contextlib.suppress(OSError):
                tmp.unlink()
            raise self.fail(key, e, total) from e
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
        return self.path(key).read_bytes()

    def read_view(self, key: str) -> memoryview:
        """The object mapped read-only into memory (no copy; pages come from the page cache or the disk)."""
        with open(self.path(key), "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size == 0:
                return memoryview(b"")
            return memoryview(mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ))

    def read_into(self, key: str, offset: int, out: memoryview) -> None:
        """Thread-safe; ``preadv`` straight into ``out`` (the GIL is released while the kernel copies)."""
        view = memoryview(out).cast("B")
        total = view.nbytes
        fd = os.open(self.path(key), os.O_RDONLY | os.O_CLOEXEC)
        try:
            if pread_all(fd, view, offset) < total:
                raise EOFError(f"{key!r} in {str(self.root)!r} ends before byte {offset + total}")
        finally:
            os.close(fd)
        self.count_read(total)

    def list(self, prefix: str = "") -> list[str]:
        """Raises ``OSError`` when the tier's root exists and cannot be listed (not a directory, no permission);
        a root or prefix that does not exist lists as empty."""
        path = self.path(prefix, allow_root=True)
        try:
            return sorted(p.name for p in path.iterdir() if not p.name.startswith("."))
        except FileNotFoundError:
            return []
        except NotADirectoryError:
            if path == self.root:
                raise
            return []

    def delete(self, key: str) -> None:
        path = self.path(key)
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            with contextlib.suppress(FileNotFoundError):
                path.unlink()

    def exists(self, key: str) -> bool:
        return self.path(key).is_file()

    def modified(self, key: str) -> float | None:
        """The newest ``st_mtime`` of ``key`` and of every file and directory under it (hidden ones included: a
        manifest being committed is a hidden temporary file); a file being written changes it with every write."""
        path = self.path(key)
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
