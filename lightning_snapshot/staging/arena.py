"""The host staging arena and the asynchronous copy into it.

:class:`HostArena` is made by the fit's session (session.py), staged into by the snapshot pipeline (pipeline.py,
``stage_async`` at each snapshot step), and its slots are released by the persist threads (persist.py) once written.

This module is :class:`HostArena` (slots within a memory budget, their CUDA registration, planning and
``stage_async``) and re-exports the arena's names as imported before the split; the parts, one job each:
:mod:`~lightning_snapshot.staging.cuda_host` (``cudaHostRegister``), :mod:`~lightning_snapshot.staging.slot`
(one shared-memory buffer), :mod:`~lightning_snapshot.staging.plan` (where each tensor goes and how it is
copied) and :mod:`~lightning_snapshot.staging.transfer` (the copy in flight and its handle).

The arena is a few *slots*, each one page-aligned host buffer allocated once and reused across snapshots: shared
memory (an anonymous ``memfd_create`` file, which never has a name, so a killed trainer leaves nothing behind; where
that is missing, a ``/dev/shm`` file readable by the owning user only, unlinked at once), the same for CPU and CUDA
state. When the state holds CUDA tensors, each slot is also registered with CUDA as page-locked host memory
(:func:`cuda_host_register`, ``cudaHostRegister``), so device-to-host copies run at pinned speed, and unregistered
before it is unmapped; the snapshot agent maps the very same memory either way, so a staged snapshot survives the
trainer on CUDA as on CPU. Where registration fails (no CUDA, a memory limit), the arena stays unregistered, with one
warning naming the reason. Each tensor of a snapshot gets a 64-byte aligned place in a slot, so the slot is, byte for
byte, the data object the writer puts on disk (``O_DIRECT`` straight from it, since the slot starts on a page).

Copy contract (see DESIGN.md §1.2): when a snapshot is staged (right before the next batch is fetched) the training
thread copies what the next forward changes (buffers, anything that is not a parameter or optimizer state)
synchronously, and hands parameters and optimizer state to a copy thread (CPU: ``memmove`` in cache-sized blocks,
each block hashed right after it is copied, while it is still in the cache; one thread, GIL released for both; CUDA:
``non_blocking`` copies on a side stream, with an event). Small CPU tensors that hold a few MiB in all are copied
at once instead, in one gather from their addresses (:class:`~lightning_snapshot.staging.gather.Gather`; cheaper
than watching each for in-place changes until the fence). Before
the next ``optimizer.step`` the training thread waits for whatever is left.

What stays off the training thread: allocating and pre-faulting slots (:meth:`HostArena.reserve`, a background
thread), and, from the second snapshot on, planning. The *plan* of a snapshot (which tensors, where in the slot,
which are copied in the background, tied weights, the views into the slot) is kept and reused as long as the state
holds the same tensors (same names, addresses, shapes, strides and dtypes), which is checked at every snapshot.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import errno
import itertools
import logging
import math
import os
import threading
import time
import warnings
import weakref
from collections.abc import Callable
from typing import Any

import torch
import xxhash

from lightning_snapshot.planner import align_up, assign_writers, chunk_ranges, plan_layout
from lightning_snapshot.staging import StagedState, chunk_digests, prepare_tensors
from lightning_snapshot.staging import digest as digest_of
from lightning_snapshot.staging.cuda_host import (
    FAKE_REGISTER_ENV,
    HostRegisterError,
    cuda_host_register,
    cuda_host_unregister,
    noop_host_register,
    noop_host_unregister,
)
from lightning_snapshot.staging.gather import Gather
from lightning_snapshot.staging.live import LiveCapture
from lightning_snapshot.staging.plan import (
    _BACKGROUND,
    _BULK_BELOW,
    _BULK_NOW_BYTES,
    _CUDA_FROZEN,
    _CUDA_NOW,
    _NOW,
    _PLAIN,
    _addresses,
    _encoded,
    _key,
    _Plan,
    _split,
    _storage,
    _versions,
)
from lightning_snapshot.staging.slot import PAGE, ArenaSlot, _memfd_ok, _populate, wait_for_slot
from lightning_snapshot.staging.transfer import AsyncStaged, CopyThread, _copy_digests, _CudaLaunch

__all__ = [
    "FAKE_REGISTER_ENV",
    "PAGE",
    "ArenaSlot",
    "AsyncStaged",
    "HostArena",
    "HostRegisterError",
    "cuda_host_register",
    "cuda_host_unregister",
    "noop_host_register",
    "noop_host_unregister",
]

log = logging.getLogger(__name__)

_ALIGN = 64
_STORAGE = torch.Tensor.untyped_storage
_counter = itertools.count()


def reserve_lead(alloc_seconds: float | None, step_seconds: float | None) -> int:
    """How many steps before a snapshot a slot must be asked for (:meth:`HostArena.reserve`) to be ready when it is
    due: the steps the last allocation took, with a quarter more and one step of margin; at least 2."""
    if not alloc_seconds or not step_seconds or step_seconds <= 0:
        return 2
    return max(2, math.ceil(1.25 * alloc_seconds / step_seconds) + 1)


class HostArena:
    """Reusable, double-buffered host memory for snapshots, within an optional byte budget.

    Args:
        max_host_bytes: the most host memory the arena may hold; with room for one slot only, snapshots that come
            while it is still being persisted are skipped. None: no limit (two slots).
        slots: how many buffers to keep at most (2: stage snapshot N+1 while N is persisted).
        chunk_bytes: checksum chunk size.
        shm_dir: where the shared-memory files go where ``memfd_create`` is missing (``/dev/shm``); anonymous
            memory when that does not exist either.

    For state with CUDA tensors every slot is registered with CUDA (:func:`cuda_host_register`, on a thread of the
    arena's own that launches no CUDA work) right after it is allocated, and unregistered before it is freed. The
    first failure is reported once (a warning naming the reason); the arena then registers nothing more and stages
    into the unregistered shared memory, which the snapshot agent maps just the same.

    Slots are allocated and pre-faulted by a background thread when :meth:`reserve` (or :meth:`plan_ahead`) asks
    for one ahead of time; a snapshot that finds no free slot waits for one being allocated that way, and only
    allocates on the calling thread when none is.

    Thread-safety: ``stage_async``/``release``/``reserve`` are called from the training thread and the persist
    thread; a lock guards slot state.
    """

    def __init__(
        self,
        *,
        max_host_bytes: int | None = None,
        slots: int = 2,
        chunk_bytes: int = 8 << 20,
        shm_dir: str = "/dev/shm",
    ) -> None:
        self.max_host_bytes = max_host_bytes
        self.max_slots = slots
        self.chunk_bytes = chunk_bytes
        self.shm_dir = shm_dir
        self.slots: list[ArenaSlot] = []
        self._lock = threading.Condition()
        self._copier: CopyThread | None = None
        self._hasher: cf.ThreadPoolExecutor | None = None
        self._allocator: cf.ThreadPoolExecutor | None = None
        self._growing = 0  # bytes of slots being allocated in the background
        self._grow_error: BaseException | None = None
        self._stream: Any = None
        self._plan: _Plan | None = None
        #: The capture plan of the state staged here (see :mod:`~lightning_snapshot.staging.live`).
        self.live = LiveCapture()
        #: Storage addresses of tensors that were changed in place while being copied in the background (a torn
        #: snapshot): copied at once from then on.
        self._at_once: set[int] = set()
        self._closed = False
        #: The ``go`` of copies staged with ``hold`` (weakly), set by :meth:`close`: a copy never let go (an error
        #: before ``go``: a collective failed) cannot keep the copy thread, and the process, waiting forever.
        self._holds: weakref.WeakSet[threading.Event] = weakref.WeakSet()
        #: The CUDA device of the latest plan (what ``reserve`` registers a slot for); None: CPU state.
        self._device: int | None = None
        self._fake_register = bool(os.environ.get(FAKE_REGISTER_ENV))
        self._cuda_host: cf.ThreadPoolExecutor | None = None
        #: Why registration failed (then the arena registers nothing more), or None.
        self.register_failure: str | None = None
        self.last_skip_reason = ""
        #: Seconds the last ``stage_async`` waited for a slot being allocated in the background.
        self.last_alloc_wait = 0.0
        #: Wall seconds the latest slot took to allocate, fault in and register (None before the first): how far
        #: ahead of a snapshot :meth:`reserve` must be asked.
        self.alloc_seconds: float | None = None

    # ------------------------------------------------------------------------------------------- memory
    @property
    def allocated_bytes(self) -> int:
        """Host memory held by the slots, and by slots being allocated."""
        return sum(s.capacity for s in self.slots) + self._growing

    @property
    def planned_bytes(self) -> int | None:
        """The slot size the current plan needs (None before the first plan)."""
        return self._plan.size if self._plan is not None else None

    def _allocate(self, nbytes: int, device: int | None) -> ArenaSlot:
        """A new slot of at least ``nbytes``, registered for CUDA ``device`` (unless None or registration failed)."""
        t0 = time.perf_counter()
        slot = self._new_slot(align_up(max(nbytes, PAGE), 2 << 20))
        if device is not None:
            self._register(slot, device)
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

    # ------------------------------------------------------------------------------------------- CUDA registration
    def _registrar(self) -> tuple[Callable[[int, int, int], None], Callable[[int, int], None]]:
        """The (register, unregister) functions in use, looked up at each call (tests substitute them)."""
        if self._fake_register:
            return noop_host_register, noop_host_unregister
        return cuda_host_register, cuda_host_unregister

    def _on_cuda_host_thread(self, fn: Callable[..., None], *args: Any) -> None:
        """Run ``fn(*args)`` on the arena's registration thread (it launches no CUDA work: see
        :func:`cuda_host_register`) and wait for it; raises what ``fn`` raised."""
        with self._lock:
            if self._cuda_host is None:
                self._cuda_host = cf.ThreadPoolExecutor(
                    max_workers=1, thread_name_prefix="lightning-snapshot-cuda-host"
                )
            pool = self._cuda_host
        pool.submit(fn, *args).result()

    def _register(self, slot: ArenaSlot, device: int) -> None:
        """Register ``slot`` for CUDA ``device`` once; on the first failure, warn once and register nothing more."""
        if slot.device is not None or self.register_failure is not None or slot.capacity == 0:
            return
        register, _ = self._registrar()
        try:
            self._on_cuda_host_thread(register, slot.buffer.data_ptr(), slot.capacity, device)
        except HostRegisterError as e:
            with self._lock:
                first = self.register_failure is None
                self.register_failure = str(e)
            if first:
                warnings.warn(
                    f"lightning-snapshot: could not page-lock the snapshot staging memory for CUDA: {e}. Snapshots"
                    " are staged in unregistered (pageable) shared memory instead: device-to-host copies are slower"
                    " and hold up the training thread while they run (the snapshot agent still maps the memory, so a"
                    " staged snapshot still survives a crash). If a memory limit is the cause, raise it (ulimit -l,"
                    " the container's locked-memory limit) or lower max_host_bytes.",
                    RuntimeWarning,
                    stacklevel=2,
                )
            return
        slot.device = device

    def _unregister(self, slot: ArenaSlot) -> None:
        """Unregister ``slot`` from CUDA if it is registered; the buffer must still be mapped (it is: the slot holds
        it)."""
        if slot.device is None:
            return
        device, slot.device = slot.device, None
        _, unregister = self._registrar()
        try:
            self._on_cuda_host_thread(unregister, slot.buffer.data_ptr(), device)
        except HostRegisterError as e:
            log.warning("lightning-snapshot: %s; the staging buffer is freed anyway", e)

    def _free(self, slot: ArenaSlot) -> None:
        """Free ``slot``: unregistered from CUDA first, while its memory is still mapped, then unmapped (once nothing
        else holds a view of it) and its shared-memory file closed."""
        self._unregister(slot)
        if slot.fd >= 0:
            os.close(slot.fd)
            slot.fd = -1
        slot.buffer = torch.empty(0, dtype=torch.uint8)
        slot.plan, slot.views, slot.tensors, slot.bulk, slot._bytes = None, [], {}, [], None
        slot.bulk_bytes, slot.gathered = [], None

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
        with self._lock:
            if self._closed or self._growing:
                return False
            if any(not s.busy and s.capacity >= nbytes for s in self.slots) or not self._fits(size):
                return False
            self._growing = size
            if self._allocator is None:
                self._allocator = cf.ThreadPoolExecutor(max_workers=1, thread_name_prefix="lightning-snapshot-alloc")
        self._allocator.submit(self._grow, nbytes, self._device)
        return True

    def _grow(self, nbytes: int, device: int | None) -> None:
        slot: ArenaSlot | None = None
        error: BaseException | None = None
        try:
            slot = self._allocate(nbytes, device)
        except BaseException as e:  # the next snapshot allocates (and reports) on its own thread
            error = e
            log.debug("lightning-snapshot: background allocation of %d bytes failed", nbytes, exc_info=True)
        with self._lock:
            self._growing = 0
            self._grow_error = error
            if slot is not None:
                if self._closed:
                    self._free(slot)
                else:
                    self.slots.append(slot)
            self._lock.notify_all()

    def plan_ahead(
        self,
        obj: Any,
        frozen: Callable[[torch.Tensor], bool],
        rank: int = 0,
        world_size: int = 1,
        frozen_key: Any = None,
    ) -> int:
        """Plan the snapshot of ``obj`` (as :meth:`stage_async` would) and reserve a slot for it in the background.

        Call it once the state has its final shape (after the first optimizer step created the optimizer state),
        before the first snapshot; the first snapshot then finds its slot allocated and its plan made. Returns
        the bytes planned.
        """
        _, names, values, token = _encoded(obj)
        plan = self._plan
        if plan is None or not plan.matches(names, values, frozen_key):
            plan, _ = self._build_plan(dict(zip(names, values, strict=True)), frozen, rank, world_size, frozen_key)
            self._plan = plan if plan.cacheable else None
        plan.token = token
        self.reserve(plan.size)
        return plan.size

    def _acquire(self, nbytes: int, device: int | None) -> ArenaSlot | None:
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
        with self._lock:
            while True:
                for slot in self.slots:
                    if not slot.busy and slot.capacity >= nbytes:
                        slot.busy = True
                        return slot
                if self._growing >= size:  # a large enough slot is on its way: wait for it (or for a free one)
                    t0 = time.perf_counter()
                    self._lock.wait()
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
                wait_for_slot(self._lock, since)

    def busy(self) -> bool:
        """Whether every slot is in use (a snapshot now would wait, or allocate) and none is being allocated."""
        with self._lock:
            return not self._growing and all(s.busy for s in self.slots)

    def release(self, slot: ArenaSlot) -> None:
        with self._lock:
            slot.busy = False
            self._lock.notify_all()

    def close(self) -> None:
        """Stop the copy and allocation threads and free every slot (unregistered from CUDA first, then unmapped;
        their shared-memory files closed). A copy still held back (staged with ``hold``, never let go) runs first."""
        with self._lock:
            self._closed = True
        for go in list(self._holds):
            go.set()
        if self._copier is not None:
            self._copier.shutdown(wait=True)
            self._copier = None
        if self._hasher is not None:
            self._hasher.shutdown(wait=True)
            self._hasher = None
        if self._allocator is not None:
            self._allocator.shutdown(wait=True)
            self._allocator = None
        with self._lock:
            for s in self.slots:
                self._free(s)
            self.slots.clear()
            self._plan = None
            self.live.clear()
            pool, self._cuda_host = self._cuda_host, None
        if pool is not None:
            pool.shutdown(wait=True)

    # ------------------------------------------------------------------------------------------- planning
    def copy_at_once(self, tensors: list[torch.Tensor]) -> None:
        """Copy these tensors on the training thread from the next snapshot on (they were changed in place while
        a background copy ran: :attr:`AsyncStaged.torn`); the next snapshot makes a new plan."""
        self._at_once.update(_storage(t) for t in tensors)
        self._plan = None

    def _build_plan(
        self,
        tensors: dict[str, torch.Tensor],
        frozen: Callable[[torch.Tensor], bool],
        rank: int,
        world_size: int,
        frozen_key: Any = None,
    ) -> tuple[_Plan, list[torch.Tensor]]:
        """A new plan for ``tensors``, and the tensors to copy (in the order of its entries)."""
        at_once = self._at_once
        if at_once:
            given = frozen

            def frozen(t: torch.Tensor) -> bool:
                return given(t) and _storage(t) not in at_once

        items, aliases, shards = prepare_tensors(tensors)
        names = list(tensors)
        index = {n: i for i, n in enumerate(names)}
        nbytes_of = {name: t.numel() * t.element_size() for name, t in items}
        small = min(_BULK_BELOW, self.chunk_bytes + 1)  # (copied in bulk: one checksum chunk, hashed in one call)
        # (before this rank's share is taken: every rank watches the same tensors, so they agree on a torn copy)
        trained = [(name, t) for name, t in items if frozen(t)]
        # the bulk: trained CPU tensors the copy thread would copy (contiguous) that are small
        tiny = {name for name, t in trained if not t.is_cuda and t.is_contiguous() and nbytes_of[name] < small}
        # (then the bulk is copied at once, and not watched; not for sharded state, whose local shards differ by rank:
        # every rank must watch the same tensors)
        bulk_now = not shards and sum(map(nbytes_of.__getitem__, tiny)) <= _BULK_NOW_BYTES
        watch = [index[name] for name, _ in trained if not (bulk_now and name in tiny)]
        if world_size > 1:
            # Shards of sharded (DTensor) state are this rank's own and always written by it (prepare_tensors
            # already dropped the replicas other ranks write). The rest is replicated: only parameters and optimizer
            # state are identical on every rank; buffers (BatchNorm statistics) are not, so rank 0 writes those, as
            # Lightning's own checkpoint would.
            replicated = [i for i, (name, _) in enumerate(items) if name not in shards]
            owners = assign_writers(
                [nbytes_of[items[i][0]] for i in replicated],
                world_size,
                pinned=[None if frozen(items[i][1]) else 0 for i in replicated],
            )
            dropped = {i for i, owner in zip(replicated, owners, strict=True) if owner != rank}
            items = [item for i, item in enumerate(items) if i not in dropped]
            if rank != 0:  # rank 0 records the aliases of replicated tensors; every rank those of its shards
                aliases = {a: c for a, c in aliases.items() if c in shards}
        cacheable = (
            not shards
            and all(
                type(tensors[name]) in _PLAIN
                and t.data_ptr() == tensors[name].data_ptr()
                and t.dtype == tensors[name].dtype
                for name, t in items
            )
            and all(type(t) in _PLAIN for t in tensors.values())
        )
        # the bulk copied at once goes first, in one region of the slot: one gather copies it (see Gather)
        gathered = bulk_now and cacheable and all(t.device.type == "cpu" for name, t in items if name in tiny)
        if gathered:
            items = [item for item in items if item[0] in tiny] + [item for item in items if item[0] not in tiny]
        sizes = [(name, nbytes_of[name]) for name, _ in items]
        # tensors 64-byte aligned inside the slot; the slot itself is page-aligned, so the whole region can be
        # written with O_DIRECT in one go
        placed, size = plan_layout(sizes, _ALIGN)
        entries = []
        for (name, t), (_, offset), (_, nbytes) in zip(items, placed, sizes, strict=True):
            if t.is_cuda:
                how = _CUDA_FROZEN if frozen(t) else _CUDA_NOW
            elif frozen(t) and t.is_contiguous():
                how = _BACKGROUND
            else:
                how = _NOW  # changes before the next optimizer step (buffers), or is not contiguous: copy now
            entries.append((name, index[name], offset, nbytes, how))
        sources = [t for _, t in items]
        keys = [_key(t) for t in tensors.values()] if cacheable else []
        # (the same on every rank: which watched tensors are copied through the tensor object, if this rank copies them)
        by_object = {name for name, t in trained if t.is_cuda or name in tiny}
        watch_moved = [k for k, i in enumerate(watch) if names[i] in by_object]
        plan = _Plan(
            names,
            keys,
            entries,
            aliases,
            shards,
            size,
            self._register_device(sources),
            cacheable,
            [(name, offset, nbytes) for name, _, offset, nbytes, _ in entries],
            [
                (name, offset, t.data_ptr(), nbytes)
                for (name, _, offset, nbytes, how), t in zip(entries, sources, strict=True)
                if how == _BACKGROUND and name not in tiny
            ],
            any(how != _BACKGROUND for *_, how in entries),
            watch=watch,
            watch_names=[names[i] for i in watch],
            watch_moved=watch_moved,
            watch_ptrs=[keys[watch[k]][1] for k in watch_moved] if keys else None,
            held=[i for i, (name, _, _, _, how) in enumerate(entries) if how == _BACKGROUND and name not in tiny],
            frozen_key=frozen_key,
            bulk=[i for i, (name, *_) in enumerate(entries) if name in tiny],
            bulk_now=bulk_now,
        )
        plan.bulk_hashed = [(plan.entries[i][0], plan.entries[i][2], plan.entries[i][3]) for i in plan.bulk]
        plan.bulk_names = [plan.entries[i][0] for i in plan.bulk]
        plan.sources = [i for _, i, _, _, _ in entries]
        if gathered and plan.bulk:
            bulk = [(sources[i], entries[i]) for i in plan.bulk]
            with contextlib.suppress(ValueError):  # (then the per-tensor copy)
                plan.gather = Gather(
                    [t.data_ptr() for t, _ in bulk],
                    [e[3] for _, e in bulk],
                    [e[2] for _, e in bulk],
                    max(e[2] + e[3] for _, e in bulk),
                )
        self._device = plan.device
        return plan, sources

    def _register_device(self, sources: list[torch.Tensor]) -> int | None:
        """The CUDA device slots are registered for: that of the first CUDA tensor among ``sources``; None when
        there is none (under :data:`FAKE_REGISTER_ENV`: device 0 then, so CPU state takes the CUDA path)."""
        for t in sources:
            if t.is_cuda:
                return t.device.index if t.device.index is not None else torch.cuda.current_device()
        return 0 if self._fake_register else None

    @staticmethod
    def _views(slot: ArenaSlot, plan: _Plan, sources: list[torch.Tensor]) -> None:
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

    # ------------------------------------------------------------------------------------------- staging
    def stage_async(
        self,
        obj: Any,
        frozen: Callable[[torch.Tensor], bool],
        step: int,
        copy_hook: Callable[[], None] | None = None,
        rank: int = 0,
        world_size: int = 1,
        frozen_key: Any = None,
        hold: bool = False,
    ) -> AsyncStaged | None:
        """Stage ``obj`` into a slot. Tensors for which ``frozen(t)`` holds are copied in the background.

        With ``world_size`` > 1, ``obj`` is replicated on every rank (DDP) and this rank stages only its share of the
        frozen tensors, as :func:`~lightning_snapshot.planner.assign_writers` decides (the same on every rank); rank
        0 keeps the rest, the tree and the aliases. DTensors (ModelParallel) are staged as this rank's local shard,
        with its box of the global tensor (``StagedState.shards``); a shard held by several ranks is staged by one.

        The plan of the previous snapshot is reused when ``obj`` holds the very same tensors (then ``frozen`` is not
        called: a tensor at the same address, with the same name, shape, strides and dtype, is still what it was) and
        ``frozen_key`` (what ``frozen`` depends on, e.g. which parameters the optimizers train) is the same.

        The tensors copied while training goes on are watched: if one is changed in place before
        :meth:`AsyncStaged.fence_training`, the handle is ``torn`` and must not be committed.

        ``hold``: the background copy starts only once the handle's ``go`` is set (by the caller, or by anything that
        waits for the copy): the caller has Python work to do first, which a copy running alongside would slow down
        on a machine of few cores.

        Returns None (and sets ``last_skip_reason``) when no slot is free within the budget.
        ``copy_hook`` runs in the copy thread before copying (tests use it to slow the copy down).
        """
        started = time.monotonic()
        tree, names, values, token = _encoded(obj)
        plan = self._plan
        sources: list[torch.Tensor] | None = None
        if plan is None or not (
            (token is not None and plan.token is token and frozen_key == plan.frozen_key)
            or plan.matches(names, values, frozen_key)
        ):
            tensors = dict(zip(names, values, strict=True))
            plan, sources = self._build_plan(tensors, frozen, rank, world_size, frozen_key)
            self._plan = plan if plan.cacheable else None
        plan.token = token
        if sources is None:
            sources = list(map(values.__getitem__, plan.sources))
        size = plan.size
        slot = self._acquire(size, plan.device)
        if slot is None:
            return None
        if plan.device is not None and slot.device is None:  # (a slot reserved before this plan existed)
            self._register(slot, plan.device)
        slot.step = step
        state = StagedState(
            tree,
            aliases=plan.aliases,
            packed=slot.region(size),
            alignment=_ALIGN,
            chunk_bytes=self.chunk_bytes,
            shards=plan.shards,
            layout=plan.layout,
            total_bytes=plan.nbytes,
        )
        if slot.plan is not plan:
            self._views(slot, plan, sources)
        state.tensors = slot.tensors
        hashed: list[tuple[str, int, int]] = []  # copied on the training thread or the current CUDA stream
        side: list[list[int]] = []  # CUDA, frozen: entries copied on the side stream, in groups
        pending_now: list[tuple[torch.Tensor, torch.Tensor]] = []  # CUDA buffers: on the current stream
        if plan.mixed:  # buffers now, CUDA tensors on the side stream; the copy thread hashes them
            if plan.split is None:
                plan.split = _split(plan.entries)
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
        if self._copier is None:
            self._copier = CopyThread("lightning-snapshot-copy")
        handle = AsyncStaged(state, slot, step, cf.Future(), started=started, frozen_key=frozen_key)
        if hold:
            handle.go.clear()
            self._holds.add(handle.go)
        if plan.watch:  # (version counters now, on the training thread: compared at the fence)
            watched = list(map(values.__getitem__, plan.watch))
            moved = plan.watch_moved
            ptrs = plan.watch_ptrs if plan.watch_ptrs is not None else _addresses(list(map(watched.__getitem__, moved)))
            handle.watched = (plan.watch_names, watched, _versions(watched), moved, ptrs)
        handle._chunk_bytes = self.chunk_bytes
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
        handle.future = self._copier.submit(
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

    def _hash_pool(self) -> cf.ThreadPoolExecutor:
        """Threads that hash what the CUDA side stream copied, chunk by chunk, while it copies the rest (xxhash
        releases the GIL): the snapshot is staged, with its checksums, about when the last byte has arrived."""
        if self._hasher is None:
            self._hasher = cf.ThreadPoolExecutor(
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
