"""The RAM tier's bytes in the node's store: a write erasure codes a data object into its shares (this node's share
and the parity shares wait for :meth:`~lightning_snapshot.backends.ram.distribution.ErasureDistribution.distribute`),
and an object a restore made readable is read straight from its data shares.

:class:`RamStore` is a part that :class:`~lightning_snapshot.backends.ram.tier.RamTier` holds (its ``objects``) and
delegates the Backend's byte methods to; it reaches the node's store through the tier's
:class:`~lightning_snapshot.backends.ram.placement.RamPlacement`.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from lightning_snapshot.backends.mapped_files import close_map, map_new
from lightning_snapshot.backends.ram import erasure as _ec
from lightning_snapshot.backends.ram.node import SHM_ENV
from lightning_snapshot.backends.ram.node_store import NodeStore
from lightning_snapshot.backends.ram.placement import RamPlacement
from lightning_snapshot.backends.ram.shares import (
    EC,
    LAYOUT_KIND,
    READING_FILE,
    SHARE_FILE,
    data_share,
    digests,
    read_exactly,
    view_of,
)
from lightning_snapshot.errors import SnapshotError, SnapshotNotFoundError, SnapshotWriteError

__all__ = ["RamStore"]


class RamStore:
    """The Backend's byte methods over the node's store (the placement's ``store``)."""

    def __init__(self, placement: RamPlacement) -> None:
        self.placement = placement
        self.init_process_state()

    def init_process_state(self) -> None:
        """This process's objects in flight and readings (made again where the part was unpickled)."""
        #: key -> the layout of an object written and not yet distributed
        self.pending: dict[str, dict[str, Any]] = {}
        #: key -> the object written, until distribute() sent its shares
        self.sources: dict[str, memoryview] = {}
        #: key -> where its data shares are (see prepare_restore)
        self.readings: dict[str, dict[str, Any]] = {}
        #: key -> its file, checked once (see read_into)
        self.paths: dict[str, Path] = {}

    def __getstate__(self) -> dict[str, Any]:
        return {"placement": self.placement}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.init_process_state()

    @property
    def store(self) -> NodeStore:
        """The node's store (the placement's)."""
        return self.placement.store

    @property
    def url(self) -> str:
        return self.placement.url

    def take_new(self) -> tuple[dict[str, dict[str, Any]], dict[str, memoryview]]:
        """The objects written since the last call (their layouts, and their bytes), which the distribution places."""
        pending, self.pending = self.pending, {}
        sources, self.sources = self.sources, {}
        return pending, sources

    def forget_readings(self) -> None:
        """Forget where objects were read from (a restore begins or ends)."""
        self.readings.clear()
        self.paths.clear()

    # ------------------------------------------------------------------------------------------- bytes
    def write(self, key: str, buffers: Iterable[bytes | bytearray | memoryview]) -> int:
        self.paths.pop(key, None)
        if self.placement.erasure is None or not key.endswith(".bin"):
            return self.store.write(key, buffers)
        views = [memoryview(b).cast("B") for b in buffers]
        data = views[0] if len(views) == 1 else memoryview(bytearray().join(views))
        k, m = self.placement.erasure
        lay = _ec.layout(data.nbytes, k, m)
        ec_dir = self.store.files.path(key + EC)
        ec_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        # share 0 stays on this node and the parity shares wait here for distribute(); data shares 1..k-1 are the
        # object's own bytes, which distribute() sends from where they lie (the staging arena): no file, no copy
        files = [0, *range(k, k + m)]
        maps: dict[int, Any] = {}
        try:
            for i in files:
                maps[i] = map_new(ec_dir / str(i), lay.share_nbytes)
            _ec.encode(
                data,
                lay,
                [view_of(maps[i]) if i in maps else None for i in range(k + m)],
                threads=self.placement.threads,
            )
            sums = digests(
                [(view_of(maps[i]), 0) if i in maps else data_share(data, lay, i) for i in range(k + m)],
                self.placement.threads,
            )
        except OSError as e:
            raise SnapshotWriteError(e.errno, f"erasure-coding {key!r} into {ec_dir} failed: {e}") from e
        finally:
            for mm in maps.values():
                close_map(mm)
        self.pending[key] = {
            "layout": LAYOUT_KIND,
            "k": k,
            "m": m,
            "nbytes": lay.nbytes,
            "block": lay.block,
            "stripes": lay.stripes,
            "checksums": sums,
        }
        self.sources[key] = data
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
        reading = self.readings.get(key)
        if reading is None:
            # the path is checked once (no symlink out of the tier: ``_path`` resolves every component, some 40 us
            # a call) and remembered until the next write, delete or restore of this tier
            path = self.paths.get(key) or self.store.files.path(key)
            try:
                fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            except FileNotFoundError:
                reading = self._reading(key)
                if reading is None:
                    self._need_whole(key)
                    raise
            else:
                self.paths[key] = path
                try:
                    view = memoryview(out).cast("B")
                    read_exactly(fd, view, offset, key)
                finally:
                    os.close(fd)
                self.store.files.count_read(view.nbytes)
                return
        self._read_shares(key, reading, offset, out)

    def _reading(self, key: str) -> dict[str, Any] | None:
        """Where the data shares of the erasure-coded ``key`` are, as :meth:`prepare_restore` wrote it (or None)."""
        reading = self.readings.get(key)
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
        ec_dir = self.store.files.path(key + EC)
        reading["paths"] = [os.path.join(ec_dir, f) for f in reading["files"]]  # (joined once: reads are hot)
        self.readings[key] = reading
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
        self.store.files.count_read(n)

    @property
    def bytes_read(self) -> int:
        """Bytes read in this process (the node store's files count them)."""
        return self.store.files.bytes_read

    def _need_whole(self, key: str) -> None:
        if not self.store.exists(key) and self.store.files.path(key + EC).is_dir():
            raise SnapshotNotFoundError(
                f"{key!r} is erasure coded in the RAM tier {self.url}; it is rebuilt by prepare_restore() (the"
                " callback does this on resume)"
            )

    def list(self, prefix: str = "") -> list[str]:
        names = {n[: -len(EC)] if n.endswith(EC) else n for n in self.store.list(prefix)}
        return sorted(names)

    def delete(self, key: str) -> None:
        self.paths.clear()
        self.store.delete(key)
        if key:
            self.store.delete(key + EC)

    def exists(self, key: str) -> bool:
        return self.store.exists(key) or (key.endswith(".bin") and self.store.files.path(key + EC).is_dir())

    def require_exists(self) -> None:
        place = self.placement
        if (self.placement.node_dir / "store").is_dir():
            return
        base = self.placement.node_dir.parent
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
            f"no RAM tier named {place.name or 'default'!r} on this node ({place.node_dir} does not exist); {here}"
            f" under {str(base)!r}. Name the run as ram://NAME, or set {SHM_ENV} to the base directory the job used"
        )
