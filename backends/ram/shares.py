"""The erasure-coded RAM tier's share files: how ``<object>.ec/layout.json`` and ``reading.json`` are named and
checked, which bytes of an object each data share holds, and hashing and reading share files.

Small helpers with no tier state: :class:`~lightning_snapshot.backends.ram.tier.RamTier` calls them when it encodes
an object (``write``), places the shares over the nodes (``distribute``) and restores (the inventory of a node's
shares, the rebuild, the reads from data shares).
"""

from __future__ import annotations

import json
import mmap
import os
import re
from pathlib import Path
from typing import Any

import xxhash

from lightning_snapshot.backends.mapped_files import pread_all
from lightning_snapshot.backends.ram import erasure as _ec
from lightning_snapshot.dist.forksafe import Executor
from lightning_snapshot.errors import SnapshotError
from lightning_snapshot.staging import digest

__all__ = [
    "EC",
    "LAYOUT_FILE",
    "LAYOUT_KIND",
    "READING_FILE",
    "SHARE_FILE",
    "data_share",
    "data_share_nbytes",
    "digests",
    "file_digest",
    "layout_of",
    "parse_layout",
    "read_exactly",
    "share_ok",
    "view_of",
]

#: The suffix of an erasure-coded object's directory of shares (``<object>.ec/<i>``).
EC = ".ec"
#: The share layout and the checksum of every share, next to the shares.
LAYOUT_FILE = "layout.json"
#: Which files hold an object's data shares once a restore made it readable.
READING_FILE = "reading.json"
#: How ``layout.json`` says its object is cut (see :mod:`lightning_snapshot.backends.erasure`): contiguous data shares.
LAYOUT_KIND = "contiguous-v1"
#: A share file: the node's own (``<i>``), or one a restore received or rebuilt.
SHARE_FILE = re.compile(r"^(\d+|\.\d+\.(restore|rebuilt))$")


def parse_layout(raw: bytes, key: str) -> dict[str, Any]:
    """The ``layout.json`` of ``key``, checked. Raises ``SnapshotError`` naming ``key`` when it is malformed or
    from another layout version."""
    try:
        layout = json.loads(raw)
    except ValueError as e:
        raise SnapshotError(f"share layout of {key!r} is not JSON: {e}") from None
    if isinstance(layout, dict) and layout.get("layout") != LAYOUT_KIND:
        raise SnapshotError(
            f"the shares of {key!r} were laid out by another version of lightning-snapshot"
            f" (layout {layout.get('layout', 'striped')!r}, this one reads {LAYOUT_KIND!r}); restore"
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


def layout_of(meta: dict[str, Any]) -> _ec.ShareLayout:
    """The share layout a layout dict (``layout.json``, or a write's pending entry) describes."""
    return _ec.ShareLayout(meta["k"], meta["m"], meta["nbytes"], meta["block"], meta["stripes"])


def data_share_nbytes(lay: _ec.ShareLayout, i: int) -> int:
    """Bytes of the object in data share ``i`` (the rest of the share is zeros)."""
    return max(0, min(lay.share_nbytes, lay.nbytes - i * lay.share_nbytes))


def data_share(data: memoryview, lay: _ec.ShareLayout, i: int) -> tuple[memoryview, int]:
    """Data share ``i`` of the object ``data``: its bytes of the object (a view) and the zeros that follow."""
    have = data_share_nbytes(lay, i)
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


def digests(items: list[tuple[memoryview, int]], threads: int | None) -> list[str]:
    """xxh3 of each (view + that many zero bytes) of ``items``, on several threads (xxh3 releases the GIL)."""
    workers = min(len(items), threads or min(8, os.cpu_count() or 1))
    if workers <= 1:
        return [_padded_digest(v) for v in items]
    with Executor(max_workers=workers, thread_name_prefix="lightning-snapshot-digest") as pool:
        return list(pool.map(_padded_digest, items))


#: Bytes a share is hashed in (read into a buffer that stays in the L2 cache).
_HASH_PIECE = 1 << 20


def file_digest(path: Path, size: int) -> str | None:
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


def share_ok(path: Path, size: int, checksum: str, verify: bool) -> bool:
    """Whether the share file at ``path`` can be used: ``size`` bytes and, with ``verify``, the xxh3 ``checksum``
    (without, it is trusted until a chunk read from it fails its checksum: see :meth:`RamTier.restore`)."""
    if verify:
        return file_digest(path, size) == checksum
    try:
        return os.stat(path).st_size == size
    except OSError:
        return False


def read_exactly(fd: int, view: memoryview, pos: int, key: str) -> None:
    """Fill ``view`` from ``fd`` at ``pos``; ``EOFError`` naming ``key`` when the file ends first."""
    if pread_all(fd, view, pos) < view.nbytes:
        raise EOFError(f"{key!r}: a file of the RAM tier ends before byte {pos + view.nbytes}")


def view_of(mm: mmap.mmap | None) -> memoryview:
    """A buffer over a mapping (an empty one for None, the mapping of an empty file)."""
    return memoryview(mm) if mm is not None else memoryview(bytearray(0))
