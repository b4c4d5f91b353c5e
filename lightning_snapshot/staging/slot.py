"""One arena slot: a page-aligned, pre-faulted shared-memory buffer reused across snapshots.

One job: the host memory primitives of the arena: whether anonymous memory files (``memfd_create``) can back it
(:func:`_memfd_ok`), faulting a buffer's pages in ahead of use (:func:`_populate`), :class:`ArenaSlot`, the
buffer with the views the current plan made into it, and waiting for one to be free (:func:`wait_for_slot`). Called
by :class:`~lightning_snapshot.staging.arena.HostArena` (which allocates, registers and frees slots) and
:mod:`~lightning_snapshot.staging.transfer` (the copy into one).
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from lightning_snapshot.staging import tensor_bytes

if TYPE_CHECKING:
    from lightning_snapshot.staging.plan import _Plan

__all__ = ["PAGE", "ArenaSlot"]

PAGE = 4096
_MADV_POPULATE_WRITE = 23  # Linux >= 5.14

_libc: Any = None
_memfd: bool | None = None


def _memfd_ok() -> bool:
    """Whether anonymous memory files (``memfd_create``, Linux >= 3.17) can back the arena here."""
    global _memfd
    if _memfd is None:
        _memfd = False
        if hasattr(os, "memfd_create") and os.environ.get("LIGHTNING_SNAPSHOT_ARENA_MEMFD", "1") != "0":
            try:
                fd = os.memfd_create("lightning-snapshot-probe", os.MFD_CLOEXEC)
            except OSError:
                return False
            try:
                _memfd = os.path.exists(f"/proc/self/fd/{fd}")
            finally:
                os.close(fd)
    return _memfd


def _populate(buf: torch.Tensor) -> None:
    """Fault every page of ``buf`` in now (one ``madvise(MADV_POPULATE_WRITE)``; else touching each page)."""
    global _libc
    n = buf.numel()
    if n == 0:
        return
    try:
        if _libc is None:
            _libc = ctypes.CDLL(None, use_errno=True)
        addr = buf.data_ptr()
        start = addr & ~(PAGE - 1)
        if _libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(addr + n - start), _MADV_POPULATE_WRITE) == 0:
            return
    except (OSError, AttributeError):
        pass
    for a in range(0, n, 64 << 20):  # older kernels: write every page (memset releases the GIL)
        ctypes.memset(buf.data_ptr() + a, 0, min(64 << 20, n - a))


@dataclass
class ArenaSlot:
    """One reusable host buffer. ``step`` is the stamp of the snapshot it holds; ``busy`` until persisted."""

    buffer: torch.Tensor
    step: int = -1
    busy: bool = False
    #: The shared-memory file behind ``buffer`` (its name is already unlinked), kept open so that the snapshot
    #: agent can map the same memory; -1 for anonymous memory (where no shared memory exists).
    fd: int = -1
    #: The CUDA device ``buffer`` is registered (page-locked) for, or None when it is not registered.
    device: int | None = None
    #: The plan whose views into this slot ``views`` are (reused while the plan is).
    plan: _Plan | None = None
    views: list[torch.Tensor] = field(default_factory=list)
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    #: The views of the plan's ``bulk`` entries, in that order.
    bulk: list[torch.Tensor] = field(default_factory=list)
    bulk_bytes: list[memoryview] = field(default_factory=list)
    #: The region the plan's gather copies into (the plan's bulk, placed first), as its words.
    gathered: torch.Tensor | None = None
    _bytes: memoryview | None = None

    def region(self, nbytes: int) -> memoryview:
        """The first ``nbytes`` of the buffer, as bytes (the buffer's byte view is made once)."""
        if self._bytes is None or self._bytes.nbytes != self.capacity:
            self._bytes = tensor_bytes(self.buffer)
        return self._bytes[:nbytes]

    @property
    def capacity(self) -> int:
        return self.buffer.numel()

    def view(self) -> memoryview:
        return tensor_bytes(self.buffer)


log = logging.getLogger(__name__)

#: A snapshot that has waited this long for a free slot is reported, and again each time as long again has passed.
STUCK_REPORT_S = 60.0


def wait_for_slot(cond: threading.Condition, since: float) -> None:
    """One wait (``cond`` held) for a slot to be released, of a snapshot waiting since ``since`` (``time.monotonic``):
    every slot is still being persisted, and training waits (back-pressure). Each :data:`STUCK_REPORT_S` of waiting is
    reported (a tier that is slow or stuck holds every slot, and training does not move on)."""
    before = time.monotonic() - since
    cond.wait(STUCK_REPORT_S - before % STUCK_REPORT_S)
    waited = time.monotonic() - since
    if waited // STUCK_REPORT_S > before // STUCK_REPORT_S:
        log.warning(
            "lightning-snapshot: training has waited %.0f s for a staging buffer: every one is still being persisted"
            " (a tier is slow or stuck). Snapshots wait for room instead of being skipped;"
            " SnapshotCallback(max_host_bytes=...) skips them instead",
            waited,
        )
