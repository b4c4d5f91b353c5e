"""One arena slot: a page-aligned, pre-faulted shared-memory buffer reused across snapshots.

One job: :class:`ArenaSlot`, the buffer with the views the current layout made into it, and waiting for one to be
free (:func:`wait_for_slot`). Called by :class:`~lightning_snapshot.staging.pool.SlotPool` (which allocates,
registers and frees slots), :class:`~lightning_snapshot.staging.arena.HostArena` and
:mod:`~lightning_snapshot.staging.copier` (the copy into one).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from lightning_snapshot.staging import tensor_bytes

if TYPE_CHECKING:
    from lightning_snapshot.staging.layout import SlotLayout

__all__ = ["PAGE", "ArenaSlot"]

PAGE = 4096


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
    plan: SlotLayout | None = None
    views: list[torch.Tensor] = field(default_factory=list)
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    #: The views of the plan's ``bulk`` entries, in that order.
    bulk: list[torch.Tensor] = field(default_factory=list)
    bulk_bytes: list[memoryview] = field(default_factory=list)
    #: The region the plan's gather copies into (the plan's bulk, placed first), as its words.
    gathered: torch.Tensor | None = None
    _bytes: memoryview | None = None

    def forget_views(self) -> None:
        """Drop the layout and every view into the buffer (the slot is being freed)."""
        self.plan, self.views, self.tensors, self.bulk, self._bytes = None, [], {}, [], None
        self.bulk_bytes, self.gathered = [], None

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
