"""The host staging arena and the asynchronous copy into it.

:class:`HostArena` is made by the fit's session (session.py), staged into by the snapshot pipeline (pipeline.py,
``stage_async`` at each snapshot step), and its slots are released by the persist threads (persist.py) once written.

This module is :class:`HostArena`, a facade over its parts (the plan kept between snapshots, ``stage_async``), and
re-exports the arena's names as imported before the split; the parts, one job each:
:mod:`~lightning_snapshot.staging.pool` (the slots within a memory budget, allocated ahead of time),
:mod:`~lightning_snapshot.staging.cuda_host` (``cudaHostRegister``, and the arena's registrar),
:mod:`~lightning_snapshot.staging.slot` (one shared-memory buffer), :mod:`~lightning_snapshot.staging.layout` (the
layout of a state in a slot: where each tensor goes and how it is copied, and how a layout is made),
:mod:`~lightning_snapshot.staging.copier` (the copy scheduling: now, on the CUDA side stream, by the copy thread) and
:mod:`~lightning_snapshot.staging.transfer` (the copy in flight and its handle).

The arena is a few *slots*, each one page-aligned host buffer allocated once and reused across snapshots: shared
memory (an anonymous ``memfd_create`` file, which never has a name, so a killed trainer leaves nothing behind; where
that is missing, a ``/dev/shm`` file readable by the owning user only, unlinked at once), the same for CPU and CUDA
state. When the state holds CUDA tensors, each slot is also registered with CUDA as page-locked host memory
(:func:`cuda_host_register`, ``cudaHostRegister``), so device-to-host copies run at pinned speed, and unregistered
before it is unmapped; the snapshot agent maps the very same memory either way, so a staged snapshot survives the
trainer on CUDA as on CPU. Where registration fails (no CUDA, a memory limit), the arena stays unregistered, with one
warning naming the reason. Each tensor of a snapshot gets a 64-byte aligned place in a slot, so the slot is, byte for
byte, the data object the writer puts on disk (``O_DIRECT`` straight from it, since the slot starts on a page).

Copy contract (``docs/architecture.md``, "How a snapshot is taken without stopping training"): when a snapshot is
staged (right before the next batch is fetched) the training
thread copies what the next forward changes (buffers, anything that is not a parameter or optimizer state)
synchronously, and hands parameters and optimizer state to a copy thread (CPU: ``memmove`` in cache-sized blocks,
each block hashed right after it is copied, while it is still in the cache; one thread, GIL released for both; CUDA:
``non_blocking`` copies on a side stream, with an event). Small CPU tensors that hold a few MiB in all are copied
at once instead, in one gather from their addresses (:class:`~lightning_snapshot.staging.gather.Gather`; cheaper
than watching each for in-place changes until the fence). Before
the next ``optimizer.step`` the training thread waits for whatever is left.

What stays off the training thread: allocating and pre-faulting slots (:meth:`HostArena.reserve`, a background
thread), and, from the second snapshot on, planning. The *plan* of a snapshot (its
:class:`~lightning_snapshot.staging.layout.SlotLayout`: which tensors, where in the slot, which are copied in the
background, tied weights; and the views into the slot) is kept and reused as long as the state
holds the same tensors (same names, addresses, shapes, strides and dtypes), which is checked at every snapshot.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

import torch

from lightning_snapshot.format import tree as _tree
from lightning_snapshot.staging import StagedState
from lightning_snapshot.staging.copier import SlotCopier
from lightning_snapshot.staging.cuda_host import (
    FAKE_REGISTER_ENV,
    HostRegisterError,
    cuda_host_register,
    cuda_host_unregister,
    noop_host_register,
    noop_host_unregister,
)
from lightning_snapshot.staging.layout import ALIGN, SlotLayout, build_layout, storage_address
from lightning_snapshot.staging.live import Encoded, LiveCapture
from lightning_snapshot.staging.pool import SlotPool
from lightning_snapshot.staging.slot import PAGE, ArenaSlot
from lightning_snapshot.staging.transfer import AsyncStaged

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


def reserve_lead(alloc_seconds: float | None, step_seconds: float | None) -> int:
    """How many steps before a snapshot a slot must be asked for (:meth:`HostArena.reserve`) to be ready when it is
    due: the steps the last allocation took, with a quarter more and one step of margin; at least 2."""
    if not alloc_seconds or not step_seconds or step_seconds <= 0:
        return 2
    return max(2, math.ceil(1.25 * alloc_seconds / step_seconds) + 1)


def _encoded(obj: Any) -> tuple[Any, list[str], list[torch.Tensor], object | None]:
    """(tree, tensor names, tensors, capture plan token) of ``obj``: as given when it is already
    :class:`~lightning_snapshot.staging.live.Encoded`, else encoded now."""
    if isinstance(obj, Encoded):
        return obj.tree, obj.names, obj.tensors, obj.token
    tree, tensors = _tree.encode(obj, "")
    return tree, list(tensors), list(tensors.values()), None


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
    thread; a lock guards slot state (:class:`~lightning_snapshot.staging.pool.SlotPool`).

    A facade: the slots are :attr:`pool`'s, the copy scheduling a
    :class:`~lightning_snapshot.staging.copier.SlotCopier`'s; this class keeps the plan between snapshots.
    """

    def __init__(
        self,
        *,
        max_host_bytes: int | None = None,
        slots: int = 2,
        chunk_bytes: int = 8 << 20,
        shm_dir: str = "/dev/shm",
    ) -> None:
        self.chunk_bytes = chunk_bytes
        #: The slots, their budget, allocation ahead of time and CUDA registration.
        self.pool = SlotPool(max_host_bytes=max_host_bytes, slots=slots, shm_dir=shm_dir)
        self._copier = SlotCopier(chunk_bytes)
        self._plan: SlotLayout | None = None
        #: The capture plan of the state staged here (see :mod:`~lightning_snapshot.staging.live`).
        self.live = LiveCapture()
        #: Storage addresses of tensors that were changed in place while being copied in the background (a torn
        #: snapshot): copied at once from then on.
        self._at_once: set[int] = set()

    # ------------------------------------------------------------------------------------------- memory (the pool's)
    @property
    def max_host_bytes(self) -> int | None:
        return self.pool.max_host_bytes

    @property
    def slots(self) -> list[ArenaSlot]:
        return self.pool.slots

    @property
    def allocated_bytes(self) -> int:
        """Host memory held by the slots, and by slots being allocated."""
        return self.pool.allocated_bytes

    @property
    def planned_bytes(self) -> int | None:
        """The slot size the current plan needs (None before the first plan)."""
        return self._plan.size if self._plan is not None else None

    @property
    def register_failure(self) -> str | None:
        """Why registration failed (then the arena registers nothing more), or None."""
        return self.pool.registration.failure

    @property
    def last_skip_reason(self) -> str:
        """Why the last ``stage_async`` returned None."""
        return self.pool.last_skip_reason

    @property
    def last_alloc_wait(self) -> float:
        """Seconds the last ``stage_async`` waited for a slot being allocated in the background."""
        return self.pool.last_alloc_wait

    @property
    def alloc_seconds(self) -> float | None:
        """Wall seconds the latest slot took to allocate, fault in and register (None before the first): how far
        ahead of a snapshot :meth:`reserve` must be asked."""
        return self.pool.alloc_seconds

    def reserve(self, nbytes: int) -> bool:
        """Start allocating a slot of at least ``nbytes`` in the background (:meth:`SlotPool.reserve`); returns
        whether an allocation was started. Never blocks on the allocation."""
        return self.pool.reserve(nbytes)

    def busy(self) -> bool:
        """Whether every slot is in use (a snapshot now would wait, or allocate) and none is being allocated."""
        return self.pool.busy()

    def release(self, slot: ArenaSlot) -> None:
        self.pool.release(slot)

    def close(self) -> None:
        """Stop the copy and allocation threads and free every slot (unregistered from CUDA first, then unmapped;
        their shared-memory files closed). A copy still held back (staged with ``hold``, never let go) runs first."""
        self.pool.mark_closed()
        self._copier.close()
        self.pool.close()
        with self.pool.lock:
            self._plan = None
            self.live.clear()

    # ------------------------------------------------------------------------------------------- planning
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
            plan, _ = self._build_layout(dict(zip(names, values, strict=True)), frozen, rank, world_size, frozen_key)
            self._plan = plan if plan.cacheable else None
        plan.token = token
        self.reserve(plan.size)
        return plan.size

    def copy_at_once(self, tensors: list[torch.Tensor]) -> None:
        """Copy these tensors on the training thread from the next snapshot on (they were changed in place while
        a background copy ran: :attr:`AsyncStaged.torn`); the next snapshot makes a new plan."""
        self._at_once.update(storage_address(t) for t in tensors)
        self._plan = None

    def _build_layout(
        self,
        tensors: dict[str, torch.Tensor],
        frozen: Callable[[torch.Tensor], bool],
        rank: int,
        world_size: int,
        frozen_key: Any = None,
    ) -> tuple[SlotLayout, list[torch.Tensor]]:
        """A new plan for ``tensors`` (:func:`~lightning_snapshot.staging.layout.build_layout`), and the tensors to
        copy; slots reserved from now on are registered for its CUDA device."""
        plan, sources = build_layout(
            tensors,
            frozen,
            rank,
            world_size,
            frozen_key,
            at_once=self._at_once,
            chunk_bytes=self.chunk_bytes,
            fake_register=self.pool.registration.fake,
        )
        self.pool.device = plan.device
        return plan, sources

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
        frozen tensors, as :func:`~lightning_snapshot.plan.planner.assign_writers` decides (the same on every rank);
        rank
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
            plan, sources = self._build_layout(tensors, frozen, rank, world_size, frozen_key)
            self._plan = plan if plan.cacheable else None
        plan.token = token
        if sources is None:
            sources = list(map(values.__getitem__, plan.sources))
        size = plan.size
        slot = self.pool.acquire(size, plan.device)
        if slot is None:
            return None
        if plan.device is not None and slot.device is None:  # (a slot reserved before this plan existed)
            self.pool.registration.register(slot, plan.device)
        slot.step = step
        state = StagedState(
            tree,
            aliases=plan.aliases,
            packed=slot.region(size),
            alignment=ALIGN,
            chunk_bytes=self.chunk_bytes,
            shards=plan.shards,
            layout=plan.layout,
            total_bytes=plan.nbytes,
        )
        if slot.plan is not plan:
            self._copier.views(slot, plan, sources)
        state.tensors = slot.tensors
        return self._copier.start(state, slot, plan, sources, values, step, started, frozen_key, copy_hook, hold)
