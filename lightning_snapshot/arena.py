"""The host staging arena and the asynchronous copy into it.

The arena is a few *slots*, each one page-aligned host buffer allocated once and reused across snapshots: shared
memory (a ``/dev/shm`` file, readable by the owning user only) for CPU tensors, pinned memory for CUDA tensors. Each
tensor of a snapshot gets a 64-byte aligned place in a slot, so the slot is, byte for byte, the data object the writer
puts on disk (``O_DIRECT`` straight from it, since the slot starts on a page).

Copy contract (see DESIGN.md §1.2): at ``on_train_batch_end`` the training thread copies what the next forward
changes (buffers, anything that is not a parameter or optimizer state) synchronously, and hands parameters and
optimizer state to a copy thread (CPU: ``memmove`` in chunks, one thread, GIL released; CUDA: ``non_blocking`` copies
on a side stream, with an event). Before the next ``optimizer.step`` the training thread waits for whatever is left.
The copy thread also takes the staging checksums.
"""

from __future__ import annotations

import concurrent.futures as cf
import ctypes
import itertools
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import xxhash

from lightning_snapshot.planner import align_up, assign_writers, chunk_ranges, plan_layout
from lightning_snapshot.staging import StagedState, _prepare, tensor_bytes

__all__ = ["HostArena", "ArenaSlot", "AsyncStaged", "PAGE"]

log = logging.getLogger(__name__)

PAGE = 4096
_ALIGN = 64
_COPY_CHUNK = 64 << 20
_counter = itertools.count()


def _address(view: memoryview) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(view))


@dataclass
class ArenaSlot:
    """One reusable host buffer. ``step`` is the stamp of the snapshot it holds; ``busy`` until persisted."""

    buffer: torch.Tensor
    path: str | None
    step: int = -1
    busy: bool = False
    #: The shared-memory file behind ``buffer`` (its name is already unlinked), kept open so that the snapshot
    #: agent can map the same memory; -1 for pinned or anonymous memory.
    fd: int = -1

    @property
    def capacity(self) -> int:
        return self.buffer.numel()

    def view(self) -> memoryview:
        return tensor_bytes(self.buffer)


@dataclass
class AsyncStaged:
    """A snapshot being staged into a slot. ``state`` is usable once :meth:`wait` returned."""

    state: StagedState
    slot: ArenaSlot
    step: int
    future: cf.Future[dict[str, list[str]]]
    cuda_event: Any = None
    cpu_pending: bool = True
    started: float = 0.0
    #: Seconds from the start of staging until the copy (and its checksums) finished.
    copy_seconds: float | None = None

    def done(self) -> bool:
        return self.future.done()

    def wait(self) -> None:
        """Block until the copy is finished; raises what the copy raised."""
        self.state.checksums = self.future.result()

    def fence_training(self) -> None:
        """Make training safe to mutate the sources: CPU waits for the copy; CUDA only orders the GPU streams."""
        if self.cuda_event is not None and not self.cpu_pending and not self.future.done():
            torch.cuda.current_stream().wait_event(self.cuda_event)
            return
        self.future.result()

    def verify(self) -> None:
        """Check the stamp and re-hash the slot: the staged bytes are still the ones of ``step`` (never torn)."""
        if self.slot.step != self.step:
            raise RuntimeError(f"arena slot was reused by step {self.slot.step} while step {self.step} was persisted")
        assert self.state.checksums is not None
        for name, t in self.state.tensors.items():
            view = tensor_bytes(t)
            sums = [xxhash.xxh3_64_hexdigest(view[a:b]) for a, b in chunk_ranges(view.nbytes, self._chunk_bytes)]
            if sums != self.state.checksums[name]:
                raise RuntimeError(f"staged bytes of {name!r} changed after staging (step {self.step}); not committed")

    _chunk_bytes: int = 8 << 20


class HostArena:
    """Reusable, double-buffered host memory for snapshots, within an optional byte budget.

    Args:
        max_host_bytes: the most host memory the arena may hold; with room for one slot only, snapshots that come
            while it is still being persisted are skipped. None: no limit (two slots).
        slots: how many buffers to keep at most (2: stage snapshot N+1 while N is persisted).
        chunk_bytes: checksum chunk size.
        shm_dir: where the shared-memory files go (``/dev/shm``); anonymous memory when it does not exist.

    Thread-safety: ``stage_async``/``release`` are called from the training thread and the persist thread; a lock
    guards slot state.
    """

    def __init__(self, *, max_host_bytes: int | None = None, slots: int = 2, chunk_bytes: int = 8 << 20,
                 shm_dir: str = "/dev/shm") -> None:
        self.max_host_bytes = max_host_bytes
        self.max_slots = slots
        self.chunk_bytes = chunk_bytes
        self.shm_dir = shm_dir
        self.slots: list[ArenaSlot] = []
        self._lock = threading.Condition()
        self._copier: cf.ThreadPoolExecutor | None = None
        self._stream: Any = None
        self.last_skip_reason = ""

    # ------------------------------------------------------------------------------------------- memory
    @property
    def allocated_bytes(self) -> int:
        return sum(s.capacity for s in self.slots)

    def _allocate(self, nbytes: int, pin: bool) -> ArenaSlot:
        nbytes = align_up(max(nbytes, PAGE), 2 << 20)
        if pin:
            buf = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
            path = None
        elif os.path.isdir(self.shm_dir):
            path = os.path.join(self.shm_dir, f"lightning-snapshot-{os.getpid()}-{next(_counter)}")
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
            try:
                os.ftruncate(fd, nbytes)
                buf = torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)
            except BaseException:
                os.close(fd)
                raise
            finally:
                # the mapping stays; the name goes at once, so a killed trainer leaves no shared memory behind
                os.unlink(path)
            buf.zero_()  # fault every page in now, not on the hot path
            return ArenaSlot(buf, None, fd=fd)
        else:
            buf, path = torch.empty(nbytes, dtype=torch.uint8), None
        buf.zero_()  # fault every page in now, not on the hot path
        return ArenaSlot(buf, path)

    def _free(self, slot: ArenaSlot) -> None:
        if slot.fd >= 0:
            os.close(slot.fd)
            slot.fd = -1
        if slot.path is not None:
            try:
                os.unlink(slot.path)
            except FileNotFoundError:
                pass
        slot.buffer = torch.empty(0, dtype=torch.uint8)

    def _acquire(self, nbytes: int, pin: bool) -> ArenaSlot | None:
        """A free slot of at least ``nbytes`` (allocating within the budget), or None (reason in last_skip_reason).

        Without a budget, when every slot is still being persisted, this waits for one (back-pressure: no
        scheduled snapshot is lost; the wait counts as stall). With ``max_host_bytes`` set it returns None instead.
        """
        budget = self.max_host_bytes
        size = align_up(max(nbytes, PAGE), 2 << 20)
        if budget is not None and size > budget:
            self.last_skip_reason = f"the snapshot needs {nbytes} bytes of host memory but max_host_bytes is {budget}"
            return None
        with self._lock:
            while True:
                for slot in self.slots:
                    if not slot.busy and slot.capacity >= nbytes:
                        slot.busy = True
                        return slot
                for slot in [s for s in self.slots if not s.busy]:  # free but too small: replace it
                    self.slots.remove(slot)
                    self._free(slot)
                if len(self.slots) < self.max_slots and (budget is None or self.allocated_bytes + size <= budget):
                    slot = self._allocate(nbytes, pin)
                    slot.busy = True
                    self.slots.append(slot)
                    return slot
                if budget is not None:
                    self.last_skip_reason = (
                        f"the {len(self.slots)} arena buffer(s) that max_host_bytes={budget} leaves room for are"
                        " still being persisted"
                    )
                    return None
                self._lock.wait()

    def release(self, slot: ArenaSlot) -> None:
        with self._lock:
            slot.busy = False
            self._lock.notify_all()

    def close(self) -> None:
        """Stop the copy thread and free every slot (their shared-memory files too)."""
        if self._copier is not None:
            self._copier.shutdown(wait=True)
            self._copier = None
        with self._lock:
            for s in self.slots:
                self._free(s)
            self.slots.clear()

    # ------------------------------------------------------------------------------------------- staging
    def stage_async(self, obj: Any, frozen: Callable[[torch.Tensor], bool], step: int,
                    copy_hook: Callable[[], None] | None = None, rank: int = 0, world_size: int = 1
                    ) -> AsyncStaged | None:
        """Stage ``obj`` into a slot. Tensors for which ``frozen(t)`` holds are copied in the background.

        With ``world_size`` > 1, ``obj`` is replicated on every rank (DDP) and this rank stages only its share of the
        frozen tensors, as :func:`~lightning_snapshot.planner.assign_writers` decides (the same on every rank); rank
        0 keeps the rest, the tree and the aliases. DTensors (ModelParallel) are staged as this rank's local shard,
        with its box of the global tensor (``StagedState.shards``); a shard held by several ranks is staged by one.

        Returns None (and sets ``last_skip_reason``) when no slot is free within the budget.
        ``copy_hook`` runs in the copy thread before copying (tests use it to slow the copy down).
        """
        started = time.monotonic()
        tree, items, aliases, shards = _prepare(obj, "")
        if world_size > 1:
            # Shards of sharded (DTensor) state are this rank's own and always written by it (_prepare already
            # dropped the replicas other ranks write). The rest is replicated: only parameters and optimizer state
            # are identical on every rank; buffers (BatchNorm statistics) are not, so rank 0 writes those, as
            # Lightning's own checkpoint would.
            replicated = [i for i, (name, _) in enumerate(items) if name not in shards]
            owners = assign_writers([items[i][1].numel() * items[i][1].element_size() for i in replicated],
                                    world_size, pinned=[None if frozen(items[i][1]) else 0 for i in replicated])
            dropped = {i for i, owner in zip(replicated, owners) if owner != rank}
            items = [item for i, item in enumerate(items) if i not in dropped]
            if rank != 0:  # rank 0 records the aliases of replicated tensors; every rank those of its shards
                aliases = {a: c for a, c in aliases.items() if c in shards}
        sizes = [(name, t.numel() * t.element_size()) for name, t in items]
        # tensors 64-byte aligned inside the slot; the slot itself is page-aligned, so the whole region can be
        # written with O_DIRECT in one go
        placed, size = plan_layout(sizes, _ALIGN)
        pin = any(t.is_cuda for _, t in items)
        slot = self._acquire(size, pin)
        if slot is None:
            return None
        slot.step = step
        region = slot.buffer[:size]
        state = StagedState(tree, aliases=aliases, packed=tensor_bytes(region), alignment=_ALIGN,
                            chunk_bytes=self.chunk_bytes, shards=shards)
        later: list[tuple[torch.Tensor, torch.Tensor]] = []
        cuda_pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
        for (name, t), (_, offset) in zip(items, placed):
            nbytes = t.numel() * t.element_size()
            dst = region[offset: offset + nbytes].view(t.dtype).view(t.shape)
            state.tensors[name] = dst
            if t.is_cuda:
                cuda_pairs.append((dst, t))
            elif frozen(t) and t.is_contiguous():
                later.append((dst, t))
            else:
                dst.copy_(t)  # changes before the next optimizer step (buffers) or is tiny: copy now
        events: list[Any] = []
        if cuda_pairs:
            if self._stream is None:
                self._stream = torch.cuda.Stream()
            current = torch.cuda.current_stream()
            self._stream.wait_stream(current)
            with torch.cuda.stream(self._stream):  # parameters/optimizer state: overlap the next forward/backward
                for dst, src in cuda_pairs:
                    if frozen(src):
                        dst.copy_(src, non_blocking=True)
                        src.record_stream(self._stream)
            frozen_done = torch.cuda.Event()
            frozen_done.record(self._stream)
            for dst, src in cuda_pairs:  # buffers: in stream order, so they are copied before the next forward
                if not frozen(src):
                    dst.copy_(src, non_blocking=True)
            mutable_done = torch.cuda.Event()
            mutable_done.record(current)
            events = [frozen_done, mutable_done]
        if self._copier is None:
            self._copier = cf.ThreadPoolExecutor(max_workers=1, thread_name_prefix="lightning-snapshot-copy")
        handle = AsyncStaged(state, slot, step, cf.Future(), started=started)
        handle._chunk_bytes = self.chunk_bytes
        handle.cuda_event = events[0] if events else None
        handle.cpu_pending = bool(later)
        handle.future = self._copier.submit(self._copy, handle, later, events, copy_hook)
        return handle

    def _copy(self, handle: AsyncStaged, pairs: list[tuple[torch.Tensor, torch.Tensor]], events: list[Any],
              copy_hook: Callable[[], None] | None) -> dict[str, list[str]]:
        if copy_hook is not None:
            copy_hook()
        for dst, src in pairs:
            dst_view = tensor_bytes(dst)
            d, s, n = _address(dst_view), src.data_ptr(), dst_view.nbytes
            for start in range(0, n, _COPY_CHUNK):  # memmove releases the GIL and runs on this thread only
                ctypes.memmove(d + start, s + start, min(_COPY_CHUNK, n - start))
        for event in events:
            event.synchronize()
        sums = {
            name: [xxhash.xxh3_64_hexdigest(v[a:b]) for a, b in chunk_ranges(v.nbytes, self.chunk_bytes)]
            for name, v in ((name, tensor_bytes(t)) for name, t in handle.state.tensors.items())
        }
        handle.copy_seconds = time.monotonic() - handle.started
        return sums
