"""Pure planning: where bytes go when writing, which bytes to read when loading. No I/O, no process group.

Used by writer.py and staging (object layout, chunks, which rank writes what), by loader.py (which byte ranges each
rank reads, resharding included), by read_once.py (which rank reads a chunk several ranks need) and by the RAM tier's
agent (object layout).

The geometry of boxes (a rank's box under a mesh's placements, the coverage checks) is
:mod:`~lightning_snapshot.plan.boxes`, re-exported here.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from lightning_snapshot.plan.boxes import Box, even_shards, missing_region, overlapping_boxes, shard_boxes

__all__ = [
    "Box",
    "ReadItem",
    "SharedBatch",
    "align_up",
    "assign_writers",
    "bytes_needed",
    "bytes_planned",
    "chunk_ranges",
    "even_shards",
    "missing_region",
    "overlapping_boxes",
    "plan_layout",
    "plan_shared_reads",
    "plan_tensor_reads",
    "shard_boxes",
]


def align_up(n: int, alignment: int) -> int:
    """``n`` rounded up to a multiple of ``alignment`` (a power of two)."""
    return (n + alignment - 1) & ~(alignment - 1)


def plan_layout(sizes: Sequence[tuple[str, int]], alignment: int) -> tuple[list[tuple[str, int]], int]:
    """Place blobs of the given sizes one after another in one object, each start aligned.

    Returns ``([(name, offset), ...], object_size)``; the object ends right after the last blob.
    """
    out: list[tuple[str, int]] = []
    pos = 0
    for name, n in sizes:
        pos = align_up(pos, alignment)
        out.append((name, pos))
        pos += n
    return out, pos


def chunk_ranges(nbytes: int, chunk_bytes: int) -> list[tuple[int, int]]:
    """Byte ranges ``[start, end)`` of the checksum chunks of a fragment (one empty chunk for zero bytes)."""
    if nbytes == 0:
        return [(0, 0)]
    return [(s, min(s + chunk_bytes, nbytes)) for s in range(0, nbytes, chunk_bytes)]


def assign_writers(sizes: Sequence[int], world_size: int, pinned: Sequence[int | None] | None = None) -> list[int]:
    """Which rank writes each of a list of replicated blobs, so that every rank writes about the same bytes.

    Blobs with a ``pinned`` rank go to that rank; the others, largest first, each to the rank with the fewest bytes
    so far (ties: the lowest rank). Deterministic: every rank computes the same assignment from the same input.
    Returns the writing rank per blob, in input order.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    pinned = list(pinned) if pinned is not None else [None] * len(sizes)
    load = [0] * world_size
    owner = [0] * len(sizes)
    for i, rank in enumerate(pinned):
        if rank is not None:
            owner[i] = rank
            load[rank] += sizes[i]
    for i in sorted((i for i in range(len(sizes)) if pinned[i] is None), key=lambda i: (-sizes[i], i)):
        rank = min(range(world_size), key=lambda r: (load[r], r))
        owner[i] = rank
        load[rank] += sizes[i]
    return owner


# ---------------------------------------------------------------------------------------------------- read once
#
# A restore in which several ranks need the same bytes (DDP: every rank needs the whole replicated state) reads each
# checksum chunk once per job: one of the ranks that need it reads and verifies it, and sends it to the others. The
# plan below is what every rank computes, identically, from every rank's needs; read_once.py carries it out.

#: A checksum chunk of a data object: (object key, byte offset in the object, length).
Chunk = tuple[str, int, int]


@dataclass(frozen=True)
class SharedBatch:
    """Consecutive chunks that one rank reads and verifies and then sends to the same other ranks.

    Attributes:
        reader: the rank that reads and verifies the chunks (one of the ranks that need them).
        receivers: the other ranks that need them, ascending (empty: only the reader needs them).
        chunks: the chunks, in object order.
    """

    reader: int
    receivers: tuple[int, ...]
    chunks: tuple[Chunk, ...]

    @property
    def nbytes(self) -> int:
        return sum(n for _o, _s, n in self.chunks)


def plan_shared_reads(needs: Sequence[Iterable[Chunk]], *, batch_bytes: int = 64 << 20) -> list[SharedBatch]:
    """Which rank reads each chunk that some ranks need, so that every chunk is read once in the job.

    Args:
        needs: per rank, the chunks it needs (duplicates allowed).
        batch_bytes: the most bytes of one batch (a transfer), unless one chunk is larger.

    A chunk needed by one rank is read by that rank. The chunks needed by the same ranks are split, in object order,
    into contiguous runs, one per rank that needs them, sized so that every rank ends up reading about the same
    bytes (the ranks with the fewest bytes so far read more; ties: the lowest rank). Deterministic: every rank
    computes the same plan from the same ``needs``. Returns the batches in the order their transfers run.
    """
    needers: dict[Chunk, set[int]] = {}
    for rank, chunks in enumerate(needs):
        for chunk in chunks:
            needers.setdefault(chunk, set()).add(rank)
    groups: dict[tuple[int, ...], list[Chunk]] = {}
    for chunk, ranks_of in needers.items():
        groups.setdefault(tuple(sorted(ranks_of)), []).append(chunk)
    load = [0] * len(needs)
    assigned: list[tuple[int, tuple[int, ...], Chunk]] = []  # (reader, all ranks that need it, chunk)
    # the groups of one rank first (their readers are fixed), then the others, largest first
    for ranks, chunks in sorted(groups.items(), key=lambda g: (len(g[0]) > 1, -sum(c[2] for c in g[1]), g[0])):
        chunks.sort()
        candidates = sorted(ranks, key=lambda r: (load[r], r))
        total = sum(c[2] for c in chunks)
        fair = (sum(load[r] for r in candidates) + total) / len(candidates)
        i = 0
        for k, reader in enumerate(candidates):
            share = total if k == len(candidates) - 1 else max(0.0, fair - load[reader])
            taken = 0
            while i < len(chunks) and (taken < share or k == len(candidates) - 1):
                assigned.append((reader, ranks, chunks[i]))
                taken += chunks[i][2]
                i += 1
            load[reader] += taken
            total -= taken
    batches: list[SharedBatch] = []
    for reader, ranks, chunk in sorted(assigned, key=lambda a: (a[0], a[1], a[2])):
        receivers = tuple(r for r in ranks if r != reader)
        last = batches[-1] if batches else None
        if (
            last is not None
            and last.reader == reader
            and last.receivers == receivers
            and last.nbytes + chunk[2] <= batch_bytes
        ):
            batches[-1] = SharedBatch(reader, receivers, (*last.chunks, chunk))
        else:
            batches.append(SharedBatch(reader, receivers, (chunk,)))
    return batches


# ---------------------------------------------------------------------------------------------------- resharding
#
# Geometry for loading a snapshot into a different world size or parallelism than it was saved with, modelled on
# torch DCP's ``planner_helpers.create_read_items_for_chunk_list``: every saved fragment and every rank's target
# shard is a box of the global tensor; a rank reads, from each fragment that overlaps its box, the bytes of the
# overlap (expanded to whole checksum chunks so that every byte read is verified) and copies the overlap across.
# Pure: no I/O, no process group, no torch.distributed.


# -- which bytes to read


@dataclass(frozen=True)
class ReadItem:
    """What a rank reads from one saved fragment, and where the bytes go.

    Attributes:
        tensor: name of the tensor.
        object: key of the data object holding the fragment.
        offset: byte offset of the fragment in that object; ``read_ranges`` are relative to it.
        fragment_index: index of the fragment in the entry's fragments (for its checksums).
        fragment_shape: the fragment's ``local_shape`` (its bytes are this shape, row-major).
        nbytes: the fragment's size in bytes.
        chunk_bytes: the snapshot's checksum chunk size.
        read_ranges: byte ranges ``[start, end)`` of the fragment to read: the row-major runs of the overlap,
            expanded to whole checksum chunks and merged, sorted.
        chunk_indices: the checksum chunks that ``read_ranges`` consist of, sorted (every byte read is verified).
        src_box: the overlap, in the fragment's local coordinates.
        dst_box: the same overlap, in the target shard's local coordinates.
    """

    tensor: str
    object: str
    offset: int
    fragment_index: int
    fragment_shape: tuple[int, ...]
    nbytes: int
    chunk_bytes: int
    read_ranges: tuple[tuple[int, int], ...]
    chunk_indices: tuple[int, ...]
    src_box: Box
    dst_box: Box

    @property
    def bytes_planned(self) -> int:
        """Bytes this item reads."""
        return sum(e - s for s, e in self.read_ranges)

    def object_ranges(self) -> tuple[tuple[int, int], ...]:
        """``read_ranges`` as byte ranges of the data object."""
        return tuple((self.offset + s, self.offset + e) for s, e in self.read_ranges)

    def chunk_range(self, index: int) -> tuple[int, int]:
        """Byte range ``[start, end)`` of checksum chunk ``index``, relative to the fragment."""
        return index * self.chunk_bytes, min((index + 1) * self.chunk_bytes, self.nbytes)


class _Runs:
    """The row-major contiguous runs (in elements) of a non-empty ``src`` box inside an array of ``shape``.

    Dims after ``j`` are full, so a run spans ``src.shape[j]`` rows of dim ``j``; there is one run per index of
    dims ``< j`` inside ``src`` (an overlap full in all but the first dim is one run).
    """

    def __init__(self, shape: tuple[int, ...], src: Box) -> None:
        self.strides = [math.prod(shape[d + 1 :]) for d in range(len(shape))]
        self.shape = shape
        self.numel = math.prod(shape)
        j = max(len(shape) - 1, 0)
        while j > 0 and src.offsets[j] == 0 and src.shape[j] == shape[j]:
            j -= 1
        self.j = j
        self.lo = src.offsets[:j] if j > 0 else ()
        self.hi = src.end[:j] if j > 0 else ()
        if shape:
            self.run_lo = src.offsets[j] * self.strides[j]
            self.run_hi = src.end[j] * self.strides[j]
        else:  # 0-d: one element
            self.run_lo, self.run_hi = 0, 1

    @property
    def count(self) -> int:
        return math.prod(h - lo for lo, h in zip(self.lo, self.hi, strict=True))

    def _bump(self, t: list[int], d: int) -> list[int] | None:
        """Lexicographic successor of ``t[:d]`` inside the box (remaining dims at their lowest), or None."""
        for k in range(d - 1, -1, -1):
            if t[k] + 1 < self.hi[k]:
                return [*t[:k], t[k] + 1, *self.lo[k + 1 :]]
        return None

    def _run(self, t: Sequence[int]) -> tuple[int, int]:
        base = sum(i * s for i, s in zip(t, self.strides, strict=False))  # t: the outer dims only
        return base + self.run_lo, base + self.run_hi

    def first_ending_after(self, e: int) -> tuple[int, int] | None:
        """The first run (element range) whose end is past element ``e``, or None."""
        if e >= self.numel:
            return None
        x = []
        rem = e
        for s in self.strides[: self.j]:
            x.append(rem // s)
            rem %= s
        prefix: list[int] = []
        t: list[int] | None = None
        for d in range(len(x)):
            if x[d] < self.lo[d]:
                t = prefix + list(self.lo[d:])
                break
            if x[d] >= self.hi[d]:
                t = self._bump(prefix, d)
                break
            prefix.append(x[d])
        else:
            t = prefix
        if t is None:
            return None
        run = self._run(t)
        if run[1] > e:
            return run
        t = self._bump(t, len(t))
        return None if t is None else self._run(t)


def _read_ranges(
    shape: tuple[int, ...], src: Box, itemsize: int, chunk_bytes: int, nbytes: int
) -> list[tuple[int, int]]:
    """The runs of ``src`` in bytes, expanded to checksum chunks and merged.

    Walks the runs by jumping: each step takes the first run not yet covered, so the cost is bounded by both the
    number of runs and the number of chunks read, however many rows a column-sharded overlap has.
    """
    runs = _Runs(shape, src)
    out: list[list[int]] = []
    pos = 0
    while True:
        run = runs.first_ending_after(pos // itemsize)
        if run is None:
            break
        start, end = max(run[0] * itemsize, pos), run[1] * itemsize
        a = start // chunk_bytes * chunk_bytes
        b = min(-(-end // chunk_bytes) * chunk_bytes, nbytes)
        if b <= pos:  # cannot happen for a consistent geometry; never loop forever
            raise AssertionError(f"read planning made no progress at byte {pos} of a {nbytes}-byte fragment")
        if out and a <= out[-1][1]:
            out[-1][1] = b
        else:
            out.append([a, b])
        pos = b
    return [(a, b) for a, b in out]


def _subtract(box: Box, cut: Box) -> list[Box]:
    """The parts of ``box`` outside ``cut``, as disjoint boxes."""
    inter = box.intersect(cut)
    if inter is None:
        return [box]
    pieces = []
    lo, hi = list(box.offsets), list(box.end)
    for d in range(box.ndim):
        if lo[d] < inter.offsets[d]:
            phi = [*hi[:d], inter.offsets[d], *hi[d + 1 :]]
            pieces.append(Box(tuple(lo), tuple(h - low for low, h in zip(lo, phi, strict=True))))
        if inter.end[d] < hi[d]:
            plo = [*lo[:d], inter.end[d], *lo[d + 1 :]]
            pieces.append(Box(tuple(plo), tuple(h - low for low, h in zip(plo, hi, strict=True))))
        lo[d], hi[d] = inter.offsets[d], inter.end[d]
    return pieces


def plan_tensor_reads(
    entry_fragments: Any,
    global_shape: Sequence[int],
    itemsize: int,
    target: Box,
    chunk_bytes: int,
    *,
    name: str | None = None,
) -> list[ReadItem]:
    """Plan the reads that fill ``target`` (a box of the global tensor) from a tensor's saved fragments.

    For every fragment overlapping ``target``: the row-major contiguous runs of the overlap inside the fragment
    (an overlap full in all but its first dimension is one run), expanded to whole checksum chunks (chunk ``i``
    covers fragment bytes ``[i * chunk_bytes, min((i + 1) * chunk_bytes, nbytes))``) and merged. A fragment whose
    overlap is already covered by earlier fragments (a replicated save) is skipped, so no region is read twice
    from identical copies; a fragment that only partly overlaps earlier ones is read for its whole overlap.

    Read volume: each run grows by less than one chunk at each end, so the bytes planned for one fragment are at
    most the bytes needed from it plus ``2 * (chunk_bytes - 1)`` per run (per fragment when the overlap is one
    run, as for ``Shard(0)`` layouts), and never more than the fragment.

    Args:
        entry_fragments: a :class:`~lightning_snapshot.format.manifest.TensorEntry` (its name and fragments are used)
            or a sequence of :class:`~lightning_snapshot.format.manifest.Fragment`. Aliases must be resolved first.
        global_shape: the tensor's global shape.
        itemsize: bytes per element of its dtype.
        target: the box this rank needs, in global coordinates.
        chunk_bytes: the snapshot's checksum chunk size.
        name: the tensor's name for plan items and errors (default: the entry's name).

    Returns:
        One :class:`ReadItem` per fragment read, in fragment order; empty for an empty target.

    Raises:
        ValueError: the fragments do not cover ``target`` (the message names the tensor and the uncovered
            regions: a missing fragment), or a fragment or ``target`` does not fit ``global_shape``.
    """
    fragments = getattr(entry_fragments, "fragments", entry_fragments)
    if name is None:
        name = getattr(entry_fragments, "name", "<tensor>")
    global_shape = tuple(int(g) for g in global_shape)
    whole = Box.whole(global_shape)
    if chunk_bytes < 1 or itemsize < 1:
        raise ValueError(f"tensor {name!r}: chunk_bytes {chunk_bytes} and itemsize {itemsize} must be positive")
    if target.ndim != len(global_shape) or not whole.contains(target):
        raise ValueError(f"tensor {name!r}: target box {target} does not fit global shape {global_shape}")
    if target.numel == 0:
        return []
    remaining = [target]
    items: list[ReadItem] = []
    for index, frag in enumerate(fragments):
        fbox = Box(tuple(frag.global_offsets), tuple(frag.local_shape))
        if fbox.ndim != len(global_shape) or not whole.contains(fbox):
            raise ValueError(f"tensor {name!r}: fragment {index} box {fbox} does not fit global shape {global_shape}")
        if frag.nbytes != fbox.numel * itemsize:
            raise ValueError(
                f"tensor {name!r}: fragment {index} has {frag.nbytes} bytes, but its box {fbox} of"
                f" {itemsize}-byte elements has {fbox.numel * itemsize}"
            )
        n_chunks = max(1, -(-frag.nbytes // chunk_bytes))
        if len(frag.checksums) != n_chunks:
            raise ValueError(
                f"tensor {name!r}: fragment {index} has {len(frag.checksums)} checksums, but"
                f" {n_chunks} chunks of {chunk_bytes} bytes"
            )
        overlap = fbox.intersect(target)
        if overlap is None or not any(overlap.intersect(r) for r in remaining):
            continue
        remaining = [piece for r in remaining for piece in _subtract(r, overlap)]
        src = overlap.translate(fbox.offsets)
        ranges = _read_ranges(fbox.shape, src, itemsize, chunk_bytes, frag.nbytes)
        chunks = tuple(i for a, b in ranges for i in range(a // chunk_bytes, -(-b // chunk_bytes)))
        items.append(
            ReadItem(
                tensor=name,
                object=frag.object,
                offset=frag.offset,
                fragment_index=index,
                fragment_shape=fbox.shape,
                nbytes=frag.nbytes,
                chunk_bytes=chunk_bytes,
                read_ranges=tuple(ranges),
                chunk_indices=chunks,
                src_box=src,
                dst_box=overlap.translate(target.offsets),
            )
        )
    if remaining:
        shown = ", ".join(str(r) for r in remaining[:4]) + (
            f" and {len(remaining) - 4} more" if len(remaining) > 4 else ""
        )
        raise ValueError(
            f"missing fragment: tensor {name!r} has no saved fragment for region(s) {shown} (global coordinates)"
            f" of the requested box {target} of global shape {global_shape}; {sum(r.numel for r in remaining)}"
            " element(s) are not in the snapshot"
        )
    return items


def bytes_needed(target: Box, itemsize: int) -> int:
    """Bytes a rank needs for ``target``: the lower bound on what it must read."""
    return target.numel * itemsize


def bytes_planned(items: Iterable[ReadItem]) -> int:
    """Bytes the plan reads (checksum-chunk expansion included)."""
    return sum(item.bytes_planned for item in items)
