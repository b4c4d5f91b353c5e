"""Pure planning: where bytes go when writing, which bytes to read when loading. No I/O, no process group."""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["align_up", "plan_layout", "chunk_ranges"]


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
