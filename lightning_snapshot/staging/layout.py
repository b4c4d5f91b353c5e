"""The layout of a state in a slot: where each tensor goes and how it is copied; pure, no memory touched.

One job: describe a snapshot's copy so it can be reused while the state holds the same tensors (:class:`SlotLayout`,
checked with :func:`_key` and :meth:`SlotLayout.matches`), the copy kinds (background thread, training thread now,
CUDA side stream, CUDA current stream), their grouping for a mixed layout (:func:`split_copies`), and the version
counters and addresses that tell whether a tensor copied while training went on was changed in place or given new
storage (:func:`version_counters`, :func:`data_addresses`); and how a layout is made (:func:`build_layout`: this
rank's share, the offsets, which tensors are watched, copied in bulk or gathered). Called by
:class:`~lightning_snapshot.staging.arena.HostArena` (which builds layouts), :mod:`~lightning_snapshot.staging.copier`
(which copies by them) and :mod:`~lightning_snapshot.staging.transfer` (the fence reads the version counters).
"""

from __future__ import annotations

import contextlib
import operator
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from lightning_snapshot.plan.planner import assign_writers, plan_layout
from lightning_snapshot.staging import SMALL_HASH as _SMALL
from lightning_snapshot.staging import local_tensor, prepare_tensors
from lightning_snapshot.staging.gather import Gather

__all__ = [
    "ALIGN",
    "SlotLayout",
    "build_layout",
    "data_addresses",
    "register_device",
    "split_copies",
    "storage_address",
    "version_counters",
]

#: Tensors copied while training goes on that are smaller than this are copied together (one ``_foreach_copy_``,
#: which does not hold the GIL) and hashed afterwards; larger ones are copied and hashed block by block.
_BULK_BELOW = _SMALL

#: When the small tensors copied while training goes on hold no more than this in all (on every rank together), they
#: are copied on the training thread at once instead (one gather on the CPU, else one ``_foreach_copy_``): that costs
#: less than reading each one's version counter twice to tell a torn copy, and they are then not watched.
_BULK_NOW_BYTES = 4 << 20

#: How a planned tensor is copied: by the copy thread (CPU, frozen, contiguous), now on the training thread
#: (buffers, non-contiguous tensors), or on the CUDA side stream (frozen: overlapping the next forward; buffers: in
#: the order of the current stream).
_BACKGROUND, _NOW, _CUDA_FROZEN, _CUDA_NOW = 0, 1, 2, 3

#: The alignment of each tensor inside a slot (the slot itself starts on a page).
ALIGN = 64


@dataclass
class SlotLayout:
    """Where each tensor of a state goes in a slot, and how it is copied; reused while the state's tensors are the
    same ones (:meth:`sources`).

    Attributes:
        names: every tensor name the encoding found, in order; keys: what identifies each of those tensors.
        entries: per staged tensor (name, index in ``names``, offset in the slot, bytes, how it is copied).
        cacheable: False when a tensor was transformed to be staged (a DTensor's local shard, a conjugate view):
            then the layout is rebuilt at every snapshot.
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
    #: (name, offset, source address, bytes) of the tensors the copy thread copies (valid while the layout matches)
    background: list[tuple[str, int, int, int]] = field(default_factory=list)
    #: Whether any tensor is copied on the training thread or the CUDA stream (then ``background`` is not all).
    mixed: bool = False
    #: For a mixed layout, made at its first use (:func:`split_copies`): which entries are copied how.
    split: _Split | None = None
    #: Indices (into ``names``) of the tensors copied while training goes on, on any rank: their version counters
    #: are checked at the fence (:meth:`AsyncStaged.fence_training`), the same on every rank.
    watch: list[int] = field(default_factory=list)
    #: The names of ``watch``'s tensors.
    watch_names: list[str] = field(default_factory=list)
    #: Positions in ``watch`` of the tensors copied through the tensor object (on the CUDA side stream, or small ones
    #: by the copy thread), and their addresses when the layout was made (None: read at each staging). One given new
    #: storage before the fence (``.data = ...``) would be copied from that: the snapshot is then torn too.
    watch_moved: list[int] = field(default_factory=list)
    watch_ptrs: list[int] | None = None
    #: Indices (into ``entries``) of the tensors the copy thread copies from their addresses (``background``): their
    #: storages are held until copied, so that one given new storage meanwhile is still read where it was.
    held: list[int] = field(default_factory=list)
    #: What the ``frozen`` predicate it was made with depended on (see ``stage_async``).
    frozen_key: Any = None
    #: The capture plan's token (:class:`~lightning_snapshot.staging.live.Encoded`) the tensors came with when this
    #: layout last matched them: the same token again vouches for the same tensors, without checking each.
    token: object | None = None
    #: Indices (into ``entries``) of the tensors the copy thread copies in one ``torch._foreach_copy_`` (small ones;
    #: the large ones are copied and hashed block by block, see ``background``), and the rest of ``background``.
    bulk: list[int] = field(default_factory=list)
    #: Whether ``bulk`` is copied on the training thread at staging (see :data:`_BULK_NOW_BYTES`), not by the copy
    #: thread (which hashes it either way).
    bulk_now: bool = False
    bulk_hashed: list[tuple[str, int, int]] = field(default_factory=list)
    bulk_names: list[str] = field(default_factory=list)
    #: Per entry, its tensor's index in ``names``.
    sources: list[int] = field(default_factory=list)
    #: The one copy of ``bulk`` when it is copied at once from CPU tensors (placed first in the slot), else None.
    gather: Gather | None = None

    @property
    def nbytes(self) -> int:
        """Bytes of the staged tensors (without the alignment gaps)."""
        return sum(map(_THIRD, self.layout))  # (one C-level pass: this is read at every snapshot)

    def matches(self, names: list[str], values: list[torch.Tensor], frozen_key: Any = None) -> bool:
        """Whether ``values`` (an encoding's tensors, named ``names``) are the very tensors this layout was made for,
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


def version_counters(tensors: list[torch.Tensor]) -> list[int]:
    """The version counters of ``tensors`` (training thread, per snapshot): read in one C-level pass while every
    tensor keeps one, as trained parameters and optimizer state do; one by one through :func:`_version` otherwise."""
    try:
        return list(map(_VERSION, tensors))
    except RuntimeError:
        return [_version(t) for t in tensors]


_VERSION = operator.attrgetter("_version")
_PTR = torch.Tensor.data_ptr


def data_addresses(tensors: list[torch.Tensor]) -> list[int]:
    """The data addresses of ``tensors`` (a DTensor's: its local shard's), in one C-level pass where they are plain."""
    try:
        return list(map(_PTR, tensors))
    except (RuntimeError, TypeError, AttributeError):
        return [local_tensor(t).data_ptr() for t in tensors]


_THIRD = operator.itemgetter(2)


def storage_address(t: torch.Tensor) -> int:
    """The address of ``t``'s storage (what tells the tensors sharing one, as :func:`build_layout`'s ``at_once``)."""
    return int(t.untyped_storage().data_ptr())


def _key(t: torch.Tensor) -> tuple[Any, ...]:
    # the same memory, read the same way (a DTensor or other subclass never matches: its type is in the key); host
    # and device memory never share addresses, so the address also tells the device
    return (type(t), t.data_ptr(), t.shape, t.stride(), t.dtype)


#: Bytes of frozen CUDA tensors per group of side-stream copies (an event each): the copy thread hashes a group as
#: soon as it has arrived, while the stream copies the next.
_GROUP_BYTES = 128 << 20


@dataclass
class _Split:
    """How a mixed layout's entries are copied (indices into its entries): on the training thread now (CPU tensors
    that change before the next step, or are not contiguous), on the current CUDA stream (CUDA buffers), on the side
    stream in groups of about :data:`_GROUP_BYTES` (frozen CUDA tensors); and the (name, offset, bytes) of the first
    two kinds, which the copy thread hashes once the current stream is past them."""

    now: list[int]
    cuda_now: list[int]
    side: list[list[int]]
    hashed: list[tuple[str, int, int]]


def split_copies(entries: list[tuple[str, int, int, int, int]]) -> _Split:
    """Which of a mixed layout's ``entries`` are copied how (made at its first use: :attr:`SlotLayout.split`)."""
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


def build_layout(
    tensors: dict[str, torch.Tensor],
    frozen: Callable[[torch.Tensor], bool],
    rank: int,
    world_size: int,
    frozen_key: Any = None,
    *,
    at_once: set[int],
    chunk_bytes: int,
    fake_register: bool,
) -> tuple[SlotLayout, list[torch.Tensor]]:
    """A new layout for ``tensors``, and the tensors to copy (in the order of its entries).

    ``at_once``: storage addresses of tensors copied on the training thread whatever ``frozen`` says (they were
    changed in place while copied in the background); ``chunk_bytes``: the checksum chunk size; ``fake_register``:
    under :data:`~lightning_snapshot.staging.cuda_host.FAKE_REGISTER_ENV` (CPU state takes the CUDA path).
    """
    if at_once:
        given = frozen

        def frozen(t: torch.Tensor) -> bool:
            return given(t) and storage_address(t) not in at_once

    items, aliases, shards = prepare_tensors(tensors)
    names = list(tensors)
    index = {n: i for i, n in enumerate(names)}
    nbytes_of = {name: t.numel() * t.element_size() for name, t in items}
    small = min(_BULK_BELOW, chunk_bytes + 1)  # (copied in bulk: one checksum chunk, hashed in one call)
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
    placed, size = plan_layout(sizes, ALIGN)
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
    out = SlotLayout(
        names,
        keys,
        entries,
        aliases,
        shards,
        size,
        register_device(sources, fake_register),
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
    out.bulk_hashed = [(out.entries[i][0], out.entries[i][2], out.entries[i][3]) for i in out.bulk]
    out.bulk_names = [out.entries[i][0] for i in out.bulk]
    out.sources = [i for _, i, _, _, _ in entries]
    if gathered and out.bulk:
        bulk = [(sources[i], entries[i]) for i in out.bulk]
        with contextlib.suppress(ValueError):  # (then the per-tensor copy)
            out.gather = Gather(
                [t.data_ptr() for t, _ in bulk],
                [e[3] for _, e in bulk],
                [e[2] for _, e in bulk],
                max(e[2] + e[3] for _, e in bulk),
            )
    return out, sources


def register_device(sources: list[torch.Tensor], fake_register: bool) -> int | None:
    """The CUDA device slots are registered for: that of the first CUDA tensor among ``sources``; None when
    there is none (under :data:`FAKE_REGISTER_ENV`: device 0 then, so CPU state takes the CUDA path)."""
    for t in sources:
        if t.is_cuda:
            return t.device.index if t.device.index is not None else torch.cuda.current_device()
    return 0 if fake_register else None
