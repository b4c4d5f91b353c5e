"""Pure planning: where bytes go when writing, which bytes to read when loading. No I/O, no process group."""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["align_up", "plan_layout", "chunk_ranges", "assign_writers"]


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
