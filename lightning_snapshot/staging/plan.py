"""The staging plan of a state: where each tensor goes in a slot and how it is copied; pure, no memory touched.

One job: describe a snapshot's copy so it can be reused while the state holds the same tensors (:class:`_Plan`,
checked with :func:`_key` and :meth:`_Plan.matches`), the copy kinds (background thread, training thread now, CUDA
side stream, CUDA current stream), their grouping for a mixed plan (:func:`_split`), and the version counters that
tell whether a tensor copied while training went on was changed in place (:func:`_versions`). Called by
:class:`~lightning_snapshot.staging.arena.HostArena` (which builds plans) and
:mod:`~lightning_snapshot.staging.transfer` (the fence reads the version counters).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Any

import torch

from lightning_snapshot import tree as _tree
from lightning_snapshot.staging import SMALL_HASH as _SMALL
from lightning_snapshot.staging import local_tensor
from lightning_snapshot.staging.gather import Gather
from lightning_snapshot.staging.live import Encoded

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
    #: Positions in ``watch`` of the tensors copied through the tensor object (on the CUDA side stream, or small ones
    #: by the copy thread), and their addresses when the plan was made (None: read at each staging). One given new
    #: storage before the fence (``.data = ...``) would be copied from that: the snapshot is then torn too.
    watch_moved: list[int] = field(default_factory=list)
    watch_ptrs: list[int] | None = None
    #: Indices (into ``entries``) of the tensors the copy thread copies from their addresses (``background``): their
    #: storages are held until copied, so that one given new storage meanwhile is still read where it was.
    held: list[int] = field(default_factory=list)
    #: What the ``frozen`` predicate it was made with depended on (see ``stage_async``).
    frozen_key: Any = None
    #: The capture plan's token (:class:`~lightning_snapshot.staging.live.Encoded`) the tensors came with when this
    #: plan last matched them: the same token again vouches for the same tensors, without checking each.
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
_PTR = torch.Tensor.data_ptr


def _addresses(tensors: list[torch.Tensor]) -> list[int]:
    """The data addresses of ``tensors`` (a DTensor's: its local shard's), in one C-level pass where they are plain."""
    try:
        return list(map(_PTR, tensors))
    except (RuntimeError, TypeError, AttributeError):
        return [local_tensor(t).data_ptr() for t in tensors]


_THIRD = operator.itemgetter(2)


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
