"""The copy of a snapshot into its slot by its layout: what is copied now, on the CUDA side stream, and by the copy
thread.

One job: the copy scheduling of :class:`~lightning_snapshot.staging.arena.HostArena`. :class:`SlotCopier` owns the
copy thread, the CUDA side stream and the hashing threads; given a slot, a layout
(:class:`~lightning_snapshot.staging.layout.SlotLayout`) and its source tensors, :meth:`SlotCopier.start` copies on
the training thread what changes before the next step (buffers; the small tensors when they are few bytes), queues
frozen CUDA tensors on the side stream (:class:`_CudaLaunch`), records the version counters of the tensors copied
while training goes on, and submits the rest to the copy thread (:meth:`SlotCopier._copy`: memmove and checksums,
:func:`_copy_digests`), returning the :class:`~lightning_snapshot.staging.transfer.AsyncStaged` handle.
"""

from __future__ import annotations

import concurrent.futures as cf
import ctypes
import os
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

import torch
import xxhash

from lightning_snapshot.dist.forksafe import Executor, waiting
from lightning_snapshot.plan.planner import chunk_ranges
from lightning_snapshot.staging import SMALL_HASH as _SMALL
from lightning_snapshot.staging import StagedState, chunk_digests
from lightning_snapshot.staging import digest as digest_of
from lightning_snapshot.staging.layout import SlotLayout, data_addresses, split_copies, version_counters
from lightning_snapshot.staging.slot import ArenaSlot
from lightning_snapshot.staging.transfer import AsyncStaged, CopyThread

__all__ = ["SlotCopier"]

_STORAGE = torch.Tensor.untyped_storage


#: Copy-and-hash block: small enough that the block is still in the (L2) cache when it is hashed.
_FUSE_BLOCK = 1 << 20


def _copy_digests(dst: memoryview, dst_addr: int, src_addr: int, chunk_bytes: int) -> list[str]:
    """Copy ``dst.nbytes`` bytes from ``src_addr`` to ``dst`` (at ``dst_addr``); return the digests of its chunks.

    Each block is hashed right after it is copied, from the destination, while it is still in the cache: the
    digests are those of the staged bytes, as :func:`chunk_digests` of ``dst`` would give, for about the memory
    traffic of the copy alone. ``memmove`` and the streaming hash both release the GIL.
    """
    memmove = ctypes.memmove
    sums = []
    for a, b in chunk_ranges(dst.nbytes, chunk_bytes):
        if b - a < _SMALL:
            memmove(dst_addr + a, src_addr + a, b - a)
            sums.append(xxhash.xxh3_64_hexdigest(dst[a:b]))
            continue
        h = xxhash.xxh3_64()
        for x in range(a, b, _FUSE_BLOCK):
            y = min(x + _FUSE_BLOCK, b)
            memmove(dst_addr + x, src_addr + x, y - x)
            h.update(dst[x:y])
        sums.append(h.hexdigest())
    return sums


class SlotCopier:
    """Starts the copy of each staged snapshot and runs its background part on one copy thread (see the module)."""

    def __init__(self, chunk_bytes: int) -> None:
        self.chunk_bytes = chunk_bytes
        self._thread: CopyThread | None = None
        self._hasher: cf.ThreadPoolExecutor | None = None
        self._stream: Any = None
        #: The ``go`` of copies staged with ``hold`` (weakly), set by :meth:`close`: a copy never let go (an error
        #: before ``go``: a collective failed) cannot keep the copy thread, and the process, waiting forever.
        self._holds: weakref.WeakSet[threading.Event] = weakref.WeakSet()

    @staticmethod
    def views(slot: ArenaSlot, plan: SlotLayout, sources: list[torch.Tensor]) -> None:
        """Make the plan's tensors as views into ``slot`` (kept with the slot while the plan is used)."""
        region = slot.buffer
        slot.views = [
            region[offset : offset + nbytes].view(t.dtype).view(t.shape)
            for (_, _, offset, nbytes, _), t in zip(plan.entries, sources, strict=True)
        ]
        slot.tensors = {entry[0]: view for entry, view in zip(plan.entries, slot.views, strict=True)}
        slot.bulk = list(map(slot.views.__getitem__, plan.bulk))
        packed = slot.region(plan.size)
        slot.bulk_bytes = [packed[offset : offset + nbytes] for _, offset, nbytes in plan.bulk_hashed]
        if plan.gather is not None:
            slot.gathered = region[: plan.gather.size].view(plan.gather.dtype)
        slot.plan = plan

    def start(
        self,
        state: StagedState,
        slot: ArenaSlot,
        plan: SlotLayout,
        sources: list[torch.Tensor],
        values: list[torch.Tensor],
        step: int,
        started: float,
        frozen_key: Any,
        copy_hook: Callable[[], None] | None,
        hold: bool,
    ) -> AsyncStaged:
        """Copy ``sources`` (``plan``'s tensors, in the order of its entries; ``values``: every tensor of the
        encoding) into ``slot``, the rest by the copy thread; the handle of ``state`` (see ``HostArena.stage_async``).
        """
        hashed: list[tuple[str, int, int]] = []  # copied on the training thread or the current CUDA stream
        side: list[list[int]] = []  # CUDA, frozen: entries copied on the side stream, in groups
        pending_now: list[tuple[torch.Tensor, torch.Tensor]] = []  # CUDA buffers: on the current stream
        if plan.mixed:  # buffers now, CUDA tensors on the side stream; the copy thread hashes them
            if plan.split is None:
                plan.split = split_copies(plan.entries)
            views = slot.views
            for i in plan.split.now:
                views[i].copy_(sources[i].detach())
            pending_now = [(views[i], sources[i]) for i in plan.split.cuda_now]
            side, hashed = plan.split.side, plan.split.hashed
        background = plan.background
        launch: _CudaLaunch | None = None
        events: list[Any] = []
        if side or pending_now:
            current = torch.cuda.current_stream()
            if side:
                if self._stream is None:
                    self._stream = torch.cuda.Stream()
                launch = _CudaLaunch(self._stream, torch.cuda.current_device(), plan.entries, side, slot.views, sources)
                launch.ready.record(current)
            for dst, src in pending_now:  # buffers: in stream order, copied before the next forward
                dst.copy_(src.detach(), non_blocking=True)
            mutable_done = torch.cuda.Event()
            mutable_done.record(current)
            events = [mutable_done]
        if self._thread is None:
            self._thread = CopyThread("lightning-snapshot-copy")
        handle = AsyncStaged(state, slot, step, cf.Future(), started=started, frozen_key=frozen_key)
        if hold:
            handle.go.clear()
            self._holds.add(handle.go)
        if plan.watch:  # (version counters now, on the training thread: compared at the fence)
            watched = list(map(values.__getitem__, plan.watch))
            moved = plan.watch_moved
            ptrs = (
                plan.watch_ptrs
                if plan.watch_ptrs is not None
                else data_addresses(list(map(watched.__getitem__, moved)))
            )
            handle.watched = (plan.watch_names, watched, version_counters(watched), moved, ptrs)
        handle.chunk_bytes = self.chunk_bytes
        if launch is not None:
            handle.cuda_event = launch.done[-1]
            handle.launched = launch.launched
        elif events:
            handle.cuda_event = events[0]
        bulk = None
        if plan.bulk:
            # the small tensors: at once when they are few bytes (so that they need not be watched), else by the copy
            # thread (its sources, then); hashed by the copy thread either way
            left: list[torch.Tensor] | None = None
            if plan.gather is not None:
                plan.gather(slot.gathered)  # type: ignore[arg-type]  # (made with the views)
            else:
                left = list(map(sources.__getitem__, plan.bulk))
                if plan.bulk_now:
                    with torch.no_grad():
                        torch._foreach_copy_(slot.bulk, left)
                    left = None
            bulk = (slot.bulk, left, slot.bulk_bytes, plan.bulk_names)
        handle.cpu_pending = bool(background) or (bulk is not None and bulk[1] is not None)
        # the sources stay referenced until copied (a resolved conjugate view is a temporary), and the storages of those
        # copied from their addresses: one given new storage in the next training_step (``.data = ...``) would free
        # the old one while it is read; held, the copy reads the values staged
        keep = (sources, list(map(_STORAGE, map(sources.__getitem__, plan.held))))
        handle.future = self._thread.submit(
            self._copy,
            handle,
            slot.buffer.data_ptr(),
            background,
            hashed,
            events,
            copy_hook,
            keep,
            launch,
            bulk,
        )
        handle.future.add_done_callback(lambda _: handle.copied.set())  # (also when the copy failed)
        return handle

    def close(self) -> None:
        """Let every held-back copy go, then stop the copy and hashing threads (a copy still queued runs first)."""
        for go in list(self._holds):
            go.set()
        if self._thread is not None:
            self._thread.shutdown(wait=True)
            self._thread = None
        if self._hasher is not None:
            self._hasher.shutdown(wait=True)
            self._hasher = None

    def _hash_pool(self) -> cf.ThreadPoolExecutor:
        """Threads that hash what the CUDA side stream copied, chunk by chunk, while it copies the rest (xxhash
        releases the GIL): the snapshot is staged, with its checksums, about when the last byte has arrived."""
        if self._hasher is None:
            self._hasher = Executor(
                max_workers=max(1, min(8, (os.cpu_count() or 2) // 2)), thread_name_prefix="lightning-snapshot-hash"
            )
        return self._hasher

    def _copy(
        self,
        handle: AsyncStaged,
        base: int,
        background: list[tuple[str, int, int, int]],
        hashed: list[tuple[str, int, int]],
        events: list[Any],
        copy_hook: Callable[[], None] | None,
        keepalive: Any,
        launch: _CudaLaunch | None = None,
        bulk: tuple[list[torch.Tensor], list[torch.Tensor] | None, list[memoryview], list[str]] | None = None,
    ) -> dict[str, list[str]]:
        packed = handle.state.packed
        assert packed is not None
        chunk = self.chunk_bytes
        sums: dict[str, list[str]] = {}
        with waiting():  # (held back until the training thread has taken this rank's state: see forksafe)
            handle.go.wait()
        try:
            if copy_hook is not None:
                copy_hook()
            if launch is not None:
                launch.run()
        finally:
            if launch is not None:
                launch.launched.set()
        pending: list[tuple[str, list[cf.Future[str]]]] = []
        if launch is not None:
            pool = self._hash_pool()
            for group, done in zip(launch.groups, launch.done, strict=True):
                done.synchronize()
                for i in group:
                    name, _, offset, nbytes, _ = launch.entries[i]
                    view = packed[offset : offset + nbytes]
                    pending.append((name, [pool.submit(digest_of, view[a:b]) for a, b in chunk_ranges(nbytes, chunk)]))
        if bulk is not None and bulk[1] is not None:  # the small tensors at once (without the GIL), hashed below
            with torch.no_grad():
                torch._foreach_copy_(bulk[0], bulk[1])
        for name, offset, src, nbytes in background:
            sums[name] = _copy_digests(packed[offset : offset + nbytes], base + offset, src, chunk)
        for event in events:
            event.synchronize()
        handle.copied.set()
        if bulk is not None:  # one chunk each: one C-level pass (holding the GIL only for as long as that takes)
            sums.update(zip(bulk[3], map(list, zip(map(xxhash.xxh3_64_hexdigest, bulk[2]))), strict=True))
        for name, offset, nbytes in hashed:  # copied on the training thread or the current CUDA stream
            sums[name] = chunk_digests(packed[offset : offset + nbytes], chunk)
        for name, futures in pending:
            sums[name] = [f.result() for f in futures]
        if launch is not None:
            handle.device_copy_seconds = launch.start.elapsed_time(launch.done[-1]) / 1000
            handle.device_copy_bytes = launch.nbytes
        handle.copy_seconds = time.monotonic() - handle.started
        return sums


class _CudaLaunch:
    """The device-to-host copies of a snapshot's frozen CUDA tensors, queued on the side stream by the copy thread
    (the training thread only records ``ready`` on its stream and creates the events): group by group (the plan's
    ``split.side``, indices into its entries), each followed by an event. ``done[-1]`` is what the next
    ``optimizer.step`` waits for (``fence_training``)."""

    def __init__(
        self,
        stream: Any,
        device: int,
        entries: list[tuple[str, int, int, int, int]],
        groups: list[list[int]],
        views: list[torch.Tensor],
        sources: list[torch.Tensor],
    ) -> None:
        self.stream, self.device = stream, device
        self.entries, self.groups, self.views, self.sources = entries, groups, views, sources
        self.ready = torch.cuda.Event()
        self.start = torch.cuda.Event(enable_timing=True)
        self.launched = threading.Event()
        self.done = [torch.cuda.Event(enable_timing=i == len(groups) - 1) for i in range(len(groups))]

    @property
    def nbytes(self) -> int:
        """Bytes copied on the side stream (read by the copy thread, not on the training thread)."""
        return sum(self.entries[i][3] for group in self.groups for i in group)

    def run(self) -> None:
        """Queue the copies (on the copy thread): the side stream waits for ``ready``, then copies group by group."""
        views, sources = self.views, self.sources
        with torch.cuda.device(self.device), torch.no_grad():
            self.stream.wait_event(self.ready)
            with torch.cuda.stream(self.stream):
                self.start.record(self.stream)
                for group, done in zip(self.groups, self.done, strict=True):
                    for i in group:
                        src = sources[i]
                        views[i].copy_(src, non_blocking=True)
                        src.record_stream(self.stream)
                    done.record(self.stream)
