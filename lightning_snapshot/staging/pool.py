"""The arena's slots: page-aligned shared-memory buffers within a memory budget, allocated ahead of time.

One job: the memory of :class:`~lightning_snapshot.staging.arena.HostArena`. :class:`SlotPool` allocates slots
(an anonymous ``memfd_create`` file where one can back it, :func:`_memfd_ok`; where that is missing, a ``/dev/shm``
file readable by the owning user only, unlinked at once; else anonymous memory), pre-faults them (:func:`_populate`),
registers them with CUDA where the state is on a GPU (:class:`~lightning_snapshot.staging.cuda_host.HostRegistration`),
hands a free one to each snapshot (waiting, or skipping within ``max_host_bytes``), grows in a background thread when
asked ahead of time (:meth:`SlotPool.reserve`) and frees every slot (unregistered first, then unmapped) when closed.
"""

from __future__ import annotations

import concurrent.futures as cf
import ctypes
import errno
import itertools
import logging
import os
import threading
import time
from typing import Any

import torch

from lightning_snapshot.dist.forksafe import Executor
from lightning_snapshot.plan.planner import align_up
from lightning_snapshot.staging.cuda_host import HostRegistration
from lightning_snapshot.staging.slot import PAGE, ArenaSlot, wait_for_slot

__all__ = ["SlotPool"]

log = logging.getLogger(__name__)

_counter = itertools.count()

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


class SlotPool:
    """Reusable host buffers (slots) within an optional byte budget; see :class:`~.arena.HostArena` for the
    arguments. A lock guards slot state: slots are acquired by the training thread and released by persist threads.
    """

    def __init__(self, *, max_host_bytes: int | None, slots: int, shm_dir: str) -> None:
        self.max_host_bytes = max_host_bytes
        self.max_slots = slots
        self.shm_dir = shm_dir
        self.slots: list[ArenaSlot] = []
        self.lock = threading.Condition()
        self.registration = HostRegistration(self.lock)
        self._allocator: cf.ThreadPoolExecutor | None = None
        self._growing = 0  # bytes of slots being allocated in the background
        self._grow_error: BaseException | None = None
        self._closed = False
        #: The CUDA device of the latest plan (what ``reserve`` registers a slot for); None: CPU state.
        self.device: int | None = None
        self.last_skip_reason = ""
        #: Seconds the last :meth:`acquire` waited for a slot being allocated in the background.
        self.last_alloc_wait = 0.0
        #: Wall seconds the latest slot took to allocate, fault in and register (None before the first): how far
        #: ahead of a snapshot :meth:`reserve` must be asked.
        self.alloc_seconds: float | None = None

    @property
    def allocated_bytes(self) -> int:
        """Host memory held by the slots, and by slots being allocated."""
        return sum(s.capacity for s in self.slots) + self._growing

    def _allocate(self, nbytes: int, device: int | None) -> ArenaSlot:
        """A new slot of at least ``nbytes``, registered for CUDA ``device`` (unless None or registration failed)."""
        t0 = time.perf_counter()
        slot = self._new_slot(align_up(max(nbytes, PAGE), 2 << 20))
        if device is not None:
            self.registration.register(slot, device)
        self.alloc_seconds = time.perf_counter() - t0
        return slot

    def _new_slot(self, nbytes: int) -> ArenaSlot:
        if _memfd_ok():
            # a memory file that never has a name: nothing is left behind, whenever the trainer is killed (the
            # descriptor goes to the snapshot agent, which maps the same pages)
            fd = os.memfd_create(f"lightning-snapshot-arena-{next(_counter)}", os.MFD_CLOEXEC)
            return ArenaSlot(self._map_fd(fd, f"/proc/self/fd/{fd}", nbytes), fd=fd)
        if os.path.isdir(self.shm_dir):
            path = os.path.join(self.shm_dir, f"lightning-snapshot-{os.getpid()}-{next(_counter)}")
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
            try:
                buf = self._map_fd(fd, path, nbytes)
            finally:
                # the mapping stays; the name goes at once, so a killed trainer leaves no shared memory behind (the
                # descriptor stays open for the snapshot agent)
                os.unlink(path)
            return ArenaSlot(buf, fd=fd)
        buf = torch.empty(nbytes, dtype=torch.uint8)
        _populate(buf)
        return ArenaSlot(buf)

    @staticmethod
    def _map_fd(fd: int, path: str, nbytes: int) -> torch.Tensor:
        """Size the shared-memory file ``fd`` (at ``path``) to ``nbytes``, map it and fault its pages in; closes
        ``fd`` when that fails."""
        try:
            try:  # the pages now, in the kernel: a full /dev/shm fails here, not with SIGBUS on first touch
                os.posix_fallocate(fd, 0, nbytes)
            except OSError as e:
                if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
                    raise
                os.ftruncate(fd, nbytes)
            buf = torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)
        except BaseException:
            os.close(fd)
            raise
        _populate(buf)  # map every page now, not on the hot path
        return buf

    def _free(self, slot: ArenaSlot) -> None:
        """Free ``slot``: unregistered from CUDA first, while its memory is still mapped, then unmapped (once nothing
        else holds a view of it) and its shared-memory file closed."""
        self.registration.unregister(slot)
        if slot.fd >= 0:
            os.close(slot.fd)
            slot.fd = -1
        slot.buffer = torch.empty(0, dtype=torch.uint8)
        slot.forget_views()

    def _fits(self, size: int) -> bool:
        budget = self.max_host_bytes
        return len(self.slots) + (self._growing > 0) < self.max_slots and (
            budget is None or self.allocated_bytes + size <= budget
        )

    def reserve(self, nbytes: int) -> bool:
        """Start allocating a slot of at least ``nbytes`` in a background thread, unless a free slot that large
        exists, one is already being allocated, or no other slot fits (``slots``, ``max_host_bytes``). The slot is
        registered for the CUDA device of the latest plan, if it had one.

        Returns whether an allocation was started. Never blocks on the allocation.
        """
        size = align_up(max(nbytes, PAGE), 2 << 20)
        with self.lock:
            if self._closed or self._growing:
                return False
            if any(not s.busy and s.capacity >= nbytes for s in self.slots) or not self._fits(size):
                return False
            self._growing = size
            if self._allocator is None:
                self._allocator = Executor(max_workers=1, thread_name_prefix="lightning-snapshot-alloc")
        self._allocator.submit(self._grow, nbytes, self.device)
        return True

    def _grow(self, nbytes: int, device: int | None) -> None:
        slot: ArenaSlot | None = None
        error: BaseException | None = None
        try:
            slot = self._allocate(nbytes, device)
        except BaseException as e:  # the next snapshot allocates (and reports) on its own thread
            error = e
            log.debug("lightning-snapshot: background allocation of %d bytes failed", nbytes, exc_info=True)
        with self.lock:
            self._growing = 0
            self._grow_error = error
            if slot is not None:
                if self._closed:
                    self._free(slot)
                else:
                    self.slots.append(slot)
            self.lock.notify_all()

    def acquire(self, nbytes: int, device: int | None) -> ArenaSlot | None:
        """A free slot of at least ``nbytes`` (allocating within the budget), or None (reason in last_skip_reason).

        Without a budget, when every slot is still being persisted, this waits for one (back-pressure: no
        scheduled snapshot is lost; the wait counts as stall; a long one is reported). With ``max_host_bytes`` set it
        returns None instead, unless a slot is being allocated in the background, which it waits for."""
        budget, since = self.max_host_bytes, time.monotonic()
        size = align_up(max(nbytes, PAGE), 2 << 20)
        self.last_alloc_wait = 0.0
        if budget is not None and size > budget:
            self.last_skip_reason = f"the snapshot needs {nbytes} bytes of host memory but max_host_bytes is {budget}"
            return None
        with self.lock:
            while True:
                for slot in self.slots:
                    if not slot.busy and slot.capacity >= nbytes:
                        slot.busy = True
                        return slot
                if self._growing >= size:  # a large enough slot is on its way: wait for it (or for a free one)
                    t0 = time.perf_counter()
                    self.lock.wait()
                    self.last_alloc_wait += time.perf_counter() - t0
                    continue
                for slot in [s for s in self.slots if not s.busy]:  # free but too small: replace it
                    self.slots.remove(slot)
                    self._free(slot)
                if not self._growing and self._fits(size):
                    slot = self._allocate(nbytes, device)
                    slot.busy = True
                    self.slots.append(slot)
                    return slot
                if budget is not None and not self._growing:
                    self.last_skip_reason = (
                        f"the {len(self.slots)} arena buffer(s) that max_host_bytes={budget} leaves room for are"
                        " still being persisted"
                    )
                    return None
                wait_for_slot(self.lock, since)

    def busy(self) -> bool:
        """Whether every slot is in use (a snapshot now would wait, or allocate) and none is being allocated."""
        with self.lock:
            return not self._growing and all(s.busy for s in self.slots)

    def release(self, slot: ArenaSlot) -> None:
        with self.lock:
            slot.busy = False
            self.lock.notify_all()

    def mark_closed(self) -> None:
        """No more background allocation: a slot allocated from now on is freed at once."""
        with self.lock:
            self._closed = True

    def close(self) -> None:
        """Stop the allocation thread and free every slot (unregistered from CUDA first, then unmapped; their
        shared-memory files closed). Call :meth:`mark_closed` first."""
        if self._allocator is not None:
            self._allocator.shutdown(wait=True)
            self._allocator = None
        with self.lock:
            for s in self.slots:
                self._free(s)
            self.slots.clear()
        self.registration.close()
