"""The host staging arena and the asynchronous copy into it.

The arena is a few *slots*, each one page-aligned host buffer allocated once and reused across snapshots: shared
memory (an anonymous ``memfd_create`` file, which never has a name, so a killed trainer leaves nothing behind; where
that is missing, a ``/dev/shm`` file readable by the owning user only, unlinked at once), the same for CPU and CUDA
state. When the state holds CUDA tensors, each slot is also registered with CUDA as page-locked host memory
(:func:`cuda_host_register`, ``cudaHostRegister``), so device-to-host copies run at pinned speed, and unregistered
before it is unmapped; the snapshot agent maps the very same memory either way, so a staged snapshot survives the
trainer on CUDA as on CPU. Where registration fails (no CUDA, a memory limit), the arena stays unregistered, with one
warning naming the reason. Each tensor of a snapshot gets a 64-byte aligned place in a slot, so the slot is, byte for
byte, the data object the writer puts on disk (``O_DIRECT`` straight from it, since the slot starts on a page).

Copy contract (see DESIGN.md §1.2): at ``on_train_batch_end`` the training thread copies what the next forward
changes (buffers, anything that is not a parameter or optimizer state) synchronously, and hands parameters and
optimizer state to a copy thread (CPU: ``memmove`` in cache-sized blocks, each block hashed right after it is copied,
while it is still in the cache; one thread, GIL released for both; CUDA: ``non_blocking`` copies on a side stream,
with an event). Before the next ``optimizer.step`` the training thread waits for whatever is left.

What stays off the training thread: allocating and pre-faulting slots (:meth:`HostArena.reserve`, a background
thread), and, from the second snapshot on, planning. The *plan* of a snapshot (which tensors, where in the slot,
which are copied in the background, tied weights, the views into the slot) is kept and reused as long as the state
holds the same tensors (same names, addresses, shapes, strides and dtypes), which is checked at every snapshot.
"""

from __future__ import annotations

import concurrent.futures as cf
import ctypes
import errno
import itertools
import logging
import operator
import os
import resource
import threading
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import xxhash

from lightning_snapshot import tree as _tree
from lightning_snapshot.errors import TornSnapshotError
from lightning_snapshot.planner import align_up, assign_writers, chunk_ranges, plan_layout
from lightning_snapshot.staging import SMALL_HASH as _SMALL
from lightning_snapshot.staging import StagedState, chunk_digests, prepare_tensors, tensor_bytes
from lightning_snapshot.staging import digest as digest_of
from lightning_snapshot.staging.live import Encoded, LiveCapture

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

PAGE = 4096
_ALIGN = 64
#: Copy-and-hash block: small enough that the block is still in the (L2) cache when it is hashed.
_FUSE_BLOCK = 1 << 20
_MADV_POPULATE_WRITE = 23  # Linux >= 5.14
_counter = itertools.count()
_libc: Any = None
_memfd: bool | None = None
#: ``cudaHostRegisterPortable``: the memory counts as page-locked for every CUDA context, not only the current one.
_HOST_REGISTER_PORTABLE = 1
#: Testing hook, set to a file path: every slot is treated as CUDA-registered, even for CPU-only state, and registered
#: through :func:`noop_host_register` / :func:`noop_host_unregister`, which change nothing and append their calls to
#: that file. This runs the CUDA arena path (registration, unregistration before unmapping, the agent mapping the
#: registered memory) on machines without a GPU; it is not for users.
FAKE_REGISTER_ENV = "LIGHTNING_SNAPSHOT_FAKE_CUDA_REGISTER"


class HostRegisterError(RuntimeError):
    """Host memory could not be registered with (or unregistered from) CUDA; the message says why."""


def cuda_host_register(ptr: int, nbytes: int, device: int) -> None:
    """Page-lock ``nbytes`` of host memory at ``ptr`` for CUDA (``cudaHostRegister``, portable), as ``device``.

    Call it from a thread that launches no CUDA work (the arena has one for this): a failed call leaves CUDA's
    per-thread "last error" set (torch's binding does not clear it), which torch would otherwise report at that
    thread's next kernel launch, as if that kernel had failed. It makes ``device`` the calling thread's current
    device (and leaves it so: switching back to device 0 would create a context there on every rank of a node).

    Raises:
        HostRegisterError: CUDA is not usable in this process, or the driver refused (out of memory, a limit); the
            message names the CUDA error and, where one is set, ``RLIMIT_MEMLOCK``.
    """
    cudart = _cudart_on(device)
    code = int(cudart.cudaHostRegister(ptr, nbytes, _HOST_REGISTER_PORTABLE))
    if code != 0:
        raise HostRegisterError(
            f"cudaHostRegister of {nbytes} bytes for cuda:{device} failed with"
            f" {_cuda_error(cudart, code)}{_memlock_note()}"
        )


def cuda_host_unregister(ptr: int, device: int) -> None:
    """Undo :func:`cuda_host_register` of the memory at ``ptr``; call it while the memory is still mapped, from the
    same kind of thread (it makes ``device`` the thread's current device too).

    Raises:
        HostRegisterError: CUDA refused (the message names the CUDA error).
    """
    cudart = _cudart_on(device)
    code = int(cudart.cudaHostUnregister(ptr))
    if code != 0:
        raise HostRegisterError(f"cudaHostUnregister for cuda:{device} failed with {_cuda_error(cudart, code)}")


def _cudart_on(device: int) -> Any:
    """torch's CUDA runtime bindings, with ``device`` made the calling thread's current device (a new thread's is 0:
    never touch another GPU's context)."""
    try:
        cudart = torch.cuda.cudart()
        torch.cuda.set_device(device)
    except (AssertionError, AttributeError, RuntimeError) as e:  # torch without CUDA, no driver, CUDA after fork
        raise HostRegisterError(f"CUDA is not usable in this process ({e})") from None
    return cudart


def _cuda_error(cudart: Any, code: int) -> str:
    try:
        return f"{cudart.cudaGetErrorString(cudart.cudaError(code))} (CUDA error {code})"
    except (TypeError, ValueError, RuntimeError):
        return f"CUDA error {code}"


def _memlock_note() -> str:
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    return "" if soft == resource.RLIM_INFINITY else f"; RLIMIT_MEMLOCK (ulimit -l) is {soft} bytes"


def noop_host_register(ptr: int, nbytes: int, device: int) -> None:
    """The stand-in for :func:`cuda_host_register` under :data:`FAKE_REGISTER_ENV`: registers nothing and appends
    ``register <ptr> <nbytes> <device>`` to the file that variable names."""
    _record_fake(f"register {ptr} {nbytes} {device}")


def noop_host_unregister(ptr: int, device: int) -> None:
    """The stand-in for :func:`cuda_host_unregister` under :data:`FAKE_REGISTER_ENV` (appends
    ``unregister <ptr> <device>``)."""
    _record_fake(f"unregister {ptr} {device}")


def _record_fake(line: str) -> None:
    path = os.environ.get(FAKE_REGISTER_ENV)
    if path:
        with open(path, "a", encoding="utf-8") as f:
            f.write(line + "\n")


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
    #: CUDA: seconds the side stream spent on the device-to-host copy of the frozen tensors, and their bytes.
    device_copy_seconds: float | None = None
    device_copy_bytes: int = 0
    #: CUDA: set once the copy thread has queued the side-stream copies (``cuda_event`` is recorded then).
    launched: threading.Event | None = None
    #: Set once every byte is in the slot (before the checksums are all taken), or once the copy failed.
    copied: threading.Event = field(default_factory=threading.Event)
    #: (name, tensor, version counter at staging) of each tensor copied while training goes on
    watched: list[tuple[str, torch.Tensor, int]] = field(default_factory=list)
    #: Set by the training thread once it may change the sources again (:meth:`fence_training`), with ``torn``:
    #: the watched tensors changed in place meanwhile (their copy may hold either value, or a mix): not committed.
    fenced: threading.Event = field(default_factory=threading.Event)
    torn: list[tuple[str, torch.Tensor]] = field(default_factory=list)
    #: The ``frozen_key`` it was staged under (which tensors it copies while training goes on).
    frozen_key: Any = None
    #: ``watched`` as three lists (names, tensors, versions), when the arena made them so.
    _watch: tuple[list[str], list[torch.Tensor], list[int]] | None = None

    def wait_copied(self) -> None:
        """Block until every byte is in the slot, which is then final until the slot is released (the checksums
        may still be being taken); raises what the copy raised."""
        self.copied.wait()
        if self.future.done():  # (finished, or failed: then ``copied`` was set when it ended)
            self.future.result()

    def done(self) -> bool:
        return self.future.done()

    def wait(self) -> None:
        """Block until the copy is finished; raises what the copy raised."""
        self.state.checksums = self.future.result()

    def fence_training(self) -> None:
        """Make training safe to mutate the sources: CPU waits for the copy; CUDA only orders the GPU streams.

        Also settles whether the copy holds the staged values: a tensor copied while training went on that was
        changed in place since staging (its version counter moved: user code in ``training_step`` changed a trained
        parameter before ``optimizer.step``) makes the snapshot ``torn``, and it is not committed.
        """
        try:
            if self.cuda_event is not None and not self.cpu_pending and not self.future.done():
                if self.launched is not None:
                    self.launched.wait()  # (set in a ``finally``: the copy thread cannot leave it unset)
                    if self.future.done():  # (the launch failed: raise it)
                        self.future.result()
                torch.cuda.current_stream().wait_event(self.cuda_event)
                return
            self.wait_copied()  # (the bytes: the checksums of what was copied in bulk may still be being taken)
        finally:
            self.settle()

    def changed(self) -> bool:
        """Whether a watched tensor was changed in place since staging (training thread; no data is read)."""
        return bool(self._moved())

    def _moved(self) -> list[tuple[str, torch.Tensor]]:
        if not self.watched:
            return []
        names, tensors, versions = self._watch if self._watch is not None else zip(*self.watched, strict=True)
        now = _versions(list(tensors))
        if now == list(versions):  # (one C-level comparison; the loop below only when something moved)
            return []
        return [(name, t) for name, t, version, v in zip(names, tensors, versions, now, strict=True) if v != version]

    def settle(self) -> None:
        """On the training thread, once nothing can change the copy any more (the sources are fenced, the copy had
        finished, or training is over): record which watched tensors were changed in place since staging
        (``torn``) and let the persist threads commit, or not. Idempotent."""
        if not self.fenced.is_set():
            self.torn = self._moved()
            self.watched, self._watch = [], None
            self.fenced.set()

    def await_fence(self, stop: threading.Event | None = None) -> None:
        """Block until the training thread has settled the copy (:meth:`fence_training`: at the next optimizer
        step, or when training ends); raises :class:`~lightning_snapshot.errors.TornSnapshotError` if it is torn.
        Returns early, without a verdict, once ``stop`` is set (the writer is being stopped)."""
        while not self.fenced.wait(0.5):
            if stop is not None and stop.is_set():
                raise TornSnapshotError(f"step {self.step}: stopped before training settled its copy")
        if self.torn:
            raise TornSnapshotError(
                f"step {self.step}: {', '.join(repr(n) for n, _ in self.torn[:3])}"
                f"{' and others' if len(self.torn) > 3 else ''} changed in place after on_train_batch_end and before"
                " optimizer.step (in training_step?), while being copied; the snapshot could hold either value."
                " They are copied at once from now on"
            )

    def verify(self) -> None:
        """Check the stamp and re-hash the slot: the staged bytes are still the ones of ``step`` (never torn)."""
        if self.slot.step != self.step:
            raise RuntimeError(f"arena slot was reused by step {self.slot.step} while step {self.step} was persisted")
        assert self.state.checksums is not None and self.state.packed is not None
        packed = self.state.packed
        for name, offset, nbytes in self.state.layout or ():
            if chunk_digests(packed[offset : offset + nbytes], self._chunk_bytes) != self.state.checksums[name]:
                raise RuntimeError(f"staged bytes of {name!r} changed after staging (step {self.step}); not committed")

    _chunk_bytes: int = 8 << 20


#: Tensors copied while training goes on that are smaller than this are copied together (one ``_foreach_copy_``,
#: which does not hold the GIL) and hashed afterwards; larger ones are copied and hashed block by block.
_BULK_BELOW = _SMALL

#: How a planned tensor is copied: by the copy thread (CPU, frozen, contiguous), now on the training thread
#: (buffers, non-contiguous tensors), or on the CUDA side stream (frozen: overlapping the next forward; buffers: in
#: the order of the current stream).
_BACKGROUND, _NOW, _CUDA_FROZEN, _CUDA_NOW = 0, 1, 2, 3


@dataclass
class _Plan:
    """Where each tensor of a state goes in a slot, and how it is copied; reused while the state's tensors are the
    same ones (:meth:`sources`).

    Attributes:
        names: every tensor name the encoding found, in order; keys: what identifies each of those tensors.
        entries: per staged tensor (name, index in ``names``, offset in the slot, bytes, how it is copied).
        cacheable: False when a tensor was transformed to be staged (a DTensor's local shard, a conjugate view):
            then the plan is rebuilt at every snapshot.
    """

    names: list[str]
    keys: list[tuple[Any, ...]]
    entries: list[tuple[str, int, int, int, int]]
    aliases: dict[str, str]
    shards: dict[str, tuple[tuple[int, ...], tuple[int, ...]]]
    size: int
    #: The CUDA device the slot is registered for (that of the state's CUDA tensors); None: CPU state, not registered.
    device: int | None
    cacheable: bool
    layout: list[tuple[str, int, int]] = field(default_factory=list)
    #: (name, offset, source address, bytes) of the tensors the copy thread copies (valid while the plan matches)
    background: list[tuple[str, int, int, int]] = field(default_factory=list)
    #: Whether any tensor is copied on the training thread or the CUDA stream (then ``background`` is not all).
    mixed: bool = False
    #: For a mixed plan, made at its first use (:func:`_split`): which entries are copied how.
    split: _Split | None = None
    #: Indices (into ``names``) of the tensors copied while training goes on, on any rank: their version counters
    #: are checked at the fence (:meth:`AsyncStaged.fence_training`), the same on every rank.
    watch: list[int] = field(default_factory=list)
    #: The names of ``watch``'s tensors.
    watch_names: list[str] = field(default_factory=list)
    #: What the ``frozen`` predicate it was made with depended on (see ``stage_async``).
    frozen_key: Any = None
    #: The capture plan's token (:class:`~lightning_snapshot.staging.live.Encoded`) the tensors came with when this
    #: plan last matched them: the same token again vouches for the same tensors, without checking each.
    token: object | None = None
    #: Indices (into ``entries``) of the tensors the copy thread copies in one ``torch._foreach_copy_`` (small ones;
    #: the large ones are copied and hashed block by block, see ``background``), and the rest of ``background``.
    bulk: list[int] = field(default_factory=list)
    bulk_hashed: list[tuple[str, int, int]] = field(default_factory=list)
    bulk_names: list[str] = field(default_factory=list)
    #: Per entry, its tensor's index in ``names``.
    sources: list[int] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        """Bytes of the staged tensors (without the alignment gaps)."""
        return sum(nbytes for _, _, nbytes in self.layout)

    def matches(self, names: list[str], values: list[torch.Tensor], frozen_key: Any = None) -> bool:
        """Whether ``values`` (an encoding's tensors, named ``names``) are the very tensors this plan was made for,
        under the same ``frozen_key``."""
        if len(values) != len(self.names) or frozen_key != self.frozen_key:
            return False
        try:
            keys = [_key(t) for t in values]
        except (RuntimeError, TypeError):
            return False
        return keys == self.keys and names == self.names


_PLAIN = (torch.Tensor, torch.nn.Parameter)


def _version(t: torch.Tensor) -> int:
    """``t``'s version counter (bumped by every in-place change through autograd's view of it); -1 for tensors that
    keep none (made under ``torch.inference_mode``, which cannot be changed in place outside it)."""
    try:
        return int(t._version)
    except RuntimeError:
        return -1


def _versions(tensors: list[torch.Tensor]) -> list[int]:
    """The version counters of ``tensors`` (training thread, per snapshot): read in one C-level pass while every
    tensor keeps one, as trained parameters and optimizer state do; one by one through :func:`_version` otherwise."""
    try:
        return list(map(_VERSION, tensors))
    except RuntimeError:
        return [_version(t) for t in tensors]


_VERSION = operator.attrgetter("_version")


def _storage(t: torch.Tensor) -> int:
    return int(t.untyped_storage().data_ptr())


def _key(t: torch.Tensor) -> tuple[Any, ...]:
    # the same memory, read the same way (a DTensor or other subclass never matches: its type is in the key); host
    # and device memory never share addresses, so the address also tells the device
    return (type(t), t.data_ptr(), t.shape, t.stride(), t.dtype)


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
        self._copier: cf.ThreadPoolExecutor | None = None
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
        #: The CUDA device of the latest plan (what ``reserve`` registers a slot for); None: CPU state.
        self._device: int | None = None
        self._fake_register = bool(os.environ.get(FAKE_REGISTER_ENV))
        self._cuda_host: cf.ThreadPoolExecutor | None = None
        #: Why registration failed (then the arena registers nothing more), or None.
        self.register_failure: str | None = None
        self.last_skip_reason = ""
        #: Seconds the last ``stage_async`` waited for a slot being allocated in the background.
        self.last_alloc_wait = 0.0

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
        slot = self._new_slot(align_up(max(nbytes, PAGE), 2 << 20))
        if device is not None:
            self._register(slot, device)
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
        slot.bulk_bytes = []

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
        scheduled snapshot is lost; the wait counts as stall). With ``max_host_bytes`` set it returns None instead,
        unless a slot is being allocated in the background, which it waits for.
        """
        budget = self.max_host_bytes
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
                self._lock.wait()

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
        their shared-memory files closed)."""
        with self._lock:
            self._closed = True
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
        # (before this rank's share is taken: every rank watches the same tensors, so they agree on a torn copy)
        watch = [index[name] for name, t in items if frozen(t)]
        if world_size > 1:
            # Shards of sharded (DTensor) state are this rank's own and always written by it (prepare_tensors
            # already dropped the replicas other ranks write). The rest is replicated: only parameters and optimizer
            # state are identical on every rank; buffers (BatchNorm statistics) are not, so rank 0 writes those, as
            # Lightning's own checkpoint would.
            replicated = [i for i, (name, _) in enumerate(items) if name not in shards]
            owners = assign_writers(
                [items[i][1].numel() * items[i][1].element_size() for i in replicated],
                world_size,
                pinned=[None if frozen(items[i][1]) else 0 for i in replicated],
            )
            dropped = {i for i, owner in zip(replicated, owners, strict=True) if owner != rank}
            items = [item for i, item in enumerate(items) if i not in dropped]
            if rank != 0:  # rank 0 records the aliases of replicated tensors; every rank those of its shards
                aliases = {a: c for a, c in aliases.items() if c in shards}
        sizes = [(name, t.numel() * t.element_size()) for name, t in items]
        small = min(_BULK_BELOW, self.chunk_bytes + 1)  # (copied in bulk: one checksum chunk, hashed in one call)
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
        sources = [t for _, t in items]
        plan = _Plan(
            names,
            [_key(t) for t in tensors.values()] if cacheable else [],
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
                if how == _BACKGROUND and nbytes >= small
            ],
            any(how != _BACKGROUND for *_, how in entries),
            watch=watch,
            watch_names=[names[i] for i in watch],
            frozen_key=frozen_key,
            bulk=[i for i, (*_, nbytes, how) in enumerate(entries) if how == _BACKGROUND and nbytes < small],
        )
        plan.bulk_hashed = [(plan.entries[i][0], plan.entries[i][2], plan.entries[i][3]) for i in plan.bulk]
        plan.bulk_names = [plan.entries[i][0] for i in plan.bulk]
        plan.sources = [i for _, i, _, _, _ in entries]
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
            self._copier = cf.ThreadPoolExecutor(max_workers=1, thread_name_prefix="lightning-snapshot-copy")
        handle = AsyncStaged(state, slot, step, cf.Future(), started=started, frozen_key=frozen_key)
        if plan.watch:  # (version counters now, on the training thread: compared at the fence)
            watched = list(map(values.__getitem__, plan.watch))
            counted = obj.versions if isinstance(obj, Encoded) else None  # (read as it was captured, just now)
            now = list(map(counted.__getitem__, plan.watch)) if counted is not None else _versions(watched)
            handle.watched = list(zip(plan.watch_names, watched, now, strict=True))
            handle._watch = (plan.watch_names, watched, now)
        handle._chunk_bytes = self.chunk_bytes
        if launch is not None:
            handle.cuda_event = launch.done[-1]
            handle.launched = launch.launched
        elif events:
            handle.cuda_event = events[0]
        bulk = None
        if plan.bulk:
            bulk = (slot.bulk, list(map(sources.__getitem__, plan.bulk)), slot.bulk_bytes, plan.bulk_names)
        handle.cpu_pending = bool(background or bulk)
        # the sources stay referenced until copied (a resolved conjugate view is a temporary)
        handle.future = self._copier.submit(
            self._copy,
            handle,
            slot.buffer.data_ptr(),
            background,
            hashed,
            events,
            copy_hook,
            sources,
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
        bulk: tuple[list[torch.Tensor], list[torch.Tensor], list[memoryview], list[str]] | None = None,
    ) -> dict[str, list[str]]:
        packed = handle.state.packed
        assert packed is not None
        chunk = self.chunk_bytes
        sums: dict[str, list[str]] = {}
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
        if bulk is not None:  # the small tensors at once (without the GIL), hashed below
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


#: Bytes of frozen CUDA tensors per group of side-stream copies (an event each): the copy thread hashes a group as
#: soon as it has arrived, while the stream copies the next.
_GROUP_BYTES = 128 << 20


@dataclass
class _Split:
    """How a mixed plan's entries are copied (indices into its entries): on the training thread now (CPU tensors
    that change before the next step, or are not contiguous), on the current CUDA stream (CUDA buffers), on the side
    stream in groups of about :data:`_GROUP_BYTES` (frozen CUDA tensors); and the (name, offset, bytes) of the first
    two kinds, which the copy thread hashes once the current stream is past them."""

    now: list[int]
    cuda_now: list[int]
    side: list[list[int]]
    hashed: list[tuple[str, int, int]]


def _split(entries: list[tuple[str, int, int, int, int]]) -> _Split:
    out = _Split([], [], [], [])
    size = _GROUP_BYTES
    for i, (name, _, offset, nbytes, how) in enumerate(entries):
        if how == _BACKGROUND:
            continue
        if how == _CUDA_FROZEN:
            if size >= _GROUP_BYTES:
                out.side.append([])
                size = 0
            out.side[-1].append(i)
            size += nbytes
            continue
        out.hashed.append((name, offset, nbytes))
        (out.now if how == _NOW else out.cuda_now).append(i)
    return out


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
