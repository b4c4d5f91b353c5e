"""Files as the tiers that keep them on a filesystem handle them: positional reads and writes that release the GIL,
files created with exact permissions, files mapped into memory (shared memory, for the RAM tier), and whole mapped
files sent between ranks over gloo.

No tier logic: :mod:`~lightning_snapshot.backends.local` (``LocalTier``: writes, ranged reads, the node-local
restore's transfers) and :mod:`~lightning_snapshot.backends.ram` (share files, their exchange between nodes) call it.
"""

from __future__ import annotations

import contextlib
import mmap
import os
from pathlib import Path
from typing import Any

__all__ = [
    "IO_CHUNK",
    "as_tensor",
    "close_map",
    "create_file",
    "exchange",
    "group_of",
    "map_existing",
    "map_new",
    "pread_all",
    "pwrite_all",
]

#: The most bytes one ``preadv``/``pwrite`` call moves.
IO_CHUNK = 64 << 20


def pread_all(fd: int, view: memoryview, offset: int) -> int:
    """Fill ``view`` from ``fd`` at ``offset`` (the GIL is released while the kernel copies); returns the bytes
    read, fewer than ``view`` holds only where the file ends first."""
    pos = offset
    while view.nbytes:
        n = os.preadv(fd, [view[:IO_CHUNK]], pos)
        if not n:
            break
        pos += n
        view = view[n:]
    return pos - offset


def pwrite_all(fd: int, view: memoryview, offset: int) -> None:
    """Write all of ``view`` to ``fd`` at ``offset``."""
    while view.nbytes:
        n = os.pwrite(fd, view[:IO_CHUNK], offset)
        offset += n
        view = view[n:]


def create_file(path: Path, flags: int, mode: int | None, default: int) -> int:
    """Open ``path`` creating it: permissions exactly ``mode`` when given, else ``default`` under the umask."""
    fd = os.open(path, flags | os.O_CREAT | os.O_CLOEXEC, default if mode is None else mode)
    if mode is not None:
        try:
            os.fchmod(fd, mode)  # (exactly ``mode``, whatever the umask)
        except OSError:
            os.close(fd)
            raise
    return fd


def map_new(path: Path, size: int, mode: int | None = None, default: int = 0o600) -> mmap.mmap | None:
    """A new file of ``size`` bytes (permissions: see ``create_file``), mapped writable (None for an empty one)."""
    fd = create_file(path, os.O_RDWR | os.O_TRUNC, mode, default)
    try:
        os.ftruncate(fd, size)
        return mmap.mmap(fd, size) if size else None
    finally:
        os.close(fd)


def map_existing(path: Path, write: bool = True) -> mmap.mmap | None:
    """The existing file at ``path``, mapped (writable unless ``write`` is False); None for an empty one."""
    fd = os.open(path, (os.O_RDWR if write else os.O_RDONLY) | os.O_CLOEXEC)
    try:
        size = os.fstat(fd).st_size
        if not size:
            return None
        return mmap.mmap(fd, size, access=mmap.ACCESS_WRITE if write else mmap.ACCESS_READ)
    finally:
        os.close(fd)


def close_map(mm: mmap.mmap | None) -> None:
    """Close a mapping of :func:`map_new` or :func:`map_existing` (None: nothing to close)."""
    if mm is None:
        return
    with contextlib.suppress(BufferError):  # a tensor still views it: the mapping goes with the last reference
        mm.close()


def group_of(comm: object) -> Any:
    """The torch.distributed group a tier's comm runs on (a :class:`~lightning_snapshot.dist.comm.GroupComm`'s
    ``group``), for the point-to-point transfers of whole files; None (the default group) for any other."""
    return getattr(comm, "group", None)


def exchange(
    group: Any, sends: list[tuple[mmap.mmap | None, int]], receives: list[tuple[mmap.mmap | None, int]]
) -> None:
    """Send and receive whole mapped files over the gloo ``group`` (``(map, peer's global rank)``; None: an empty
    file), all posted at once, in list order per peer; every map is closed after, also on failure."""
    import torch.distributed as dist

    works = []
    try:
        for mm, peer in sends:
            if mm is not None:
                works.append(dist.isend(as_tensor(mm), peer, group=group))
        for mm, peer in receives:
            if mm is not None:
                works.append(dist.irecv(as_tensor(mm), peer, group=group))
        for w in works:
            if w is not None:  # (None: this rank is not in the group, nothing was posted)
                w.wait()
    finally:
        works.clear()
        for mm, _peer in sends + receives:
            close_map(mm)


def as_tensor(buf: mmap.mmap | memoryview) -> Any:
    """A uint8 tensor over ``buf`` (no copy). A read-only buffer is only ever sent, never written into."""
    import warnings

    import torch

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        return torch.frombuffer(buf, dtype=torch.uint8)
