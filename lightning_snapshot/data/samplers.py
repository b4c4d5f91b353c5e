"""The resumable index samplers: replay an epoch's order from its recorded RNG and skip what was consumed.

One job: the sampler wrappers :func:`~lightning_snapshot.data.loaders.install` puts into a loader.
:class:`ResumableSampler` wraps the index sampler of a plain ``DataLoader`` (or a batch sampler of the user's own,
whole), records the RNG state the epoch's order is drawn from and, on resume, replays that draw and skips the
indices already consumed (or yields the rest of a global order split over a new number of ranks).
:class:`DrawRecorder` records the draw of a loader that Lightning restores itself. Called by
:mod:`~lightning_snapshot.data.loaders` (install, position, plan_resume) and
:mod:`~lightning_snapshot.data.workers` (the iterator tracker holds a resumed sampler back while its iterator is
created). The order arithmetic is :mod:`~lightning_snapshot.data.order`'s.
"""

from __future__ import annotations

import itertools
import warnings
from collections.abc import Iterator
from typing import Any, cast

import torch
from torch.utils.data import (
    DataLoader,
    DistributedSampler,
    RandomSampler,
    Sampler,
    SequentialSampler,
    SubsetRandomSampler,
    WeightedRandomSampler,
)

from lightning_snapshot.data.order import describe_order, epoch_of, replicas_of

__all__ = ["DrawRecorder", "ResumableSampler", "index_wrapper_of", "resumable_of"]


class _Wrapper(Sampler[int]):
    """A transparent wrapper of an index sampler: its length and every attribute not in ``_OWN`` are the wrapped
    sampler's (so Lightning's ``set_epoch`` reaches a ``DistributedSampler``)."""

    _OWN: tuple[str, ...] = ("inner",)
    inner: Any

    def __len__(self) -> int:
        return len(self.inner)

    def __getattr__(self, name: str) -> Any:
        if name in type(self)._OWN:
            raise AttributeError(name)
        return getattr(self.inner, name)


class ResumableSampler(_Wrapper):
    """Transparent wrapper of an index sampler that can replay an epoch's order and skip ahead."""

    _OWN = (
        "inner",
        "epoch_state",
        "pending",
        "order",
        "replicas",
        "base",
        "offset",
        "start_batches",
        "stream",
        "draws",
        "hold",
        "sampler_epoch",
        "batches",
        "chunk",
        "watch",
        "lazy",
        "overflowed",
    )

    #: Draws from the global RNG after the epoch's first batch that are recorded per epoch (see :meth:`_follow`).
    MAX_LAZY = 64

    def __init__(self, inner: Any, batches: bool = False, chunk: int = 1) -> None:
        self.inner = inner
        #: True: ``inner`` is a batch sampler of the user's own, which yields whole batches (lists of indices).
        self.batches = batches
        #: Items taken together, one batch (``batch_size`` indices; one for a batch sampler).
        self.chunk = max(1, int(chunk)) if not batches else 1
        #: A sampler that is not torch's own may draw from the global RNG as it yields, not only at its start.
        self.watch = type(inner) not in _TORCH_SAMPLERS
        #: (item index, global RNG state before the batch starting there) of each batch whose taking drew from the
        #: global RNG, after the epoch's first (this epoch's; at most MAX_LAZY).
        self.lazy: list[tuple[int, torch.Tensor]] = []
        self.overflowed = False
        #: (torch RNG state, sampler generator state or None) when the current epoch's order was drawn.
        self.epoch_state: tuple[torch.Tensor, torch.Tensor | None] | None = None
        self.pending: dict[str, Any] | None = None
        #: How to rebuild the current epoch's global order (:func:`describe_order`), None when it cannot be.
        self.order: dict[str, Any] | None = None
        #: Data-parallel ranks the current epoch's order is split over.
        self.replicas = 1
        #: The current epoch's stream on this rank is ``split(order, base, replicas, ...)`` from its element
        #: ``offset`` on, started when the loop had counted ``start_batches`` batches (0, 0, 0 unless resumed).
        self.base = 0
        self.offset = 0
        self.start_batches = 0
        #: This rank's indices for the next epoch, set by :func:`plan_resume` when the layout changed.
        self.stream: list[int] | None = None
        #: How many times an epoch was started (tells :func:`position` whether the current iterator drew its order).
        self.draws = 0
        #: While True, an iteration yields nothing and draws nothing (a resumed iterator's creation, see
        #: :meth:`IteratorTracker.get_iterator`).
        self.hold = False
        #: The wrapped sampler's ``epoch`` (``set_epoch``) when the current order was drawn, or None.
        self.sampler_epoch: int | None = None

    def _generator(self) -> torch.Generator | None:
        gen = getattr(self.inner, "generator", None)
        return gen if isinstance(gen, torch.Generator) else None

    def __iter__(self) -> Iterator[int]:
        if self.hold:
            return
        self.draws += 1
        pending, self.pending = self.pending, None
        stream, self.stream = self.stream, None
        if stream is not None:  # resumed on another layout: the rest of the saved global order (plan_resume)
            yield from stream
            return
        self.base = self.offset = self.start_batches = 0
        self.replicas = replicas_of(self.inner)[0]
        gen = self._generator()
        if pending is None:
            self.epoch_state = (torch.get_rng_state(), gen.get_state() if gen is not None else None)
            self.order = describe_order(self.inner, *self.epoch_state)
            self.sampler_epoch = epoch_of(self.inner)
            if not self.watch:
                yield from self.inner
                return
            self.lazy = []
            yield from self._follow(iter(self.inner), {})
            return
        # A resumed loader with workers draws when its iterator is created, which Lightning does before it calls
        # set_epoch: a DistributedSampler must draw the interrupted epoch's order
        self._set_epoch(pending)
        # Replay the RNG from which the interrupted epoch drew its order, forked: the global RNG is put back right
        # after the draw. (Without workers this runs at the first fetch, after the callback restored the global RNG
        # to the interrupted run's state: what the dataset draws next must come from that state.) A generator of
        # the sampler is left where the draw leaves it, as in the interrupted run: nobody else restores it.
        outer = torch.get_rng_state()
        try:
            torch.set_rng_state(pending["rng"])
            if gen is not None and pending.get("gen") is not None:
                gen.set_state(pending["gen"])
            self.epoch_state = (torch.get_rng_state(), gen.get_state() if gen is not None else None)
            self.order = describe_order(self.inner, *self.epoch_state)
            self.lazy = []
            it = self._follow(iter(self.inner), _lazy_records(pending.get("lazy"))) if self.watch else iter(self.inner)
            skip = int(pending.get("skip") or 0)
            if skip:  # drop the indices of the batches the interrupted run already trained on
                next(itertools.islice(it, skip, skip), None)
            # samplers draw their order when the first index is asked for. (A sampler that may draw as it yields
            # takes a batch past the skipped ones from the live RNG, as the interrupted run did after its snapshot,
            # or from its record: see _follow.)
            head = [] if self.watch and skip else list(itertools.islice(it, self.chunk if self.watch else 1))
        finally:
            torch.set_rng_state(outer)
        yield from head
        yield from it

    def _follow(self, it: Iterator[Any], recorded: dict[int, torch.Tensor]) -> Iterator[Any]:
        """The epoch's items from ``it``, a batch (``chunk`` items) at a time, for a sampler that may draw from the
        global RNG as it yields (a bucketing batch sampler that shuffles each bucket when it reaches it): each batch
        whose taking changed the global RNG is recorded with the RNG state before it (:attr:`lazy`). A batch that
        has such a record from the interrupted epoch (``recorded``, by item index) is taken from that state,
        forked: the interrupted run took it before its snapshot, whose restored RNG already holds that draw."""
        n, live, before = 0, None, None
        while True:
            if n % self.chunk == 0:
                state = recorded.get(n)
                if state is not None:
                    live = torch.get_rng_state()
                    torch.set_rng_state(state)
                    self.lazy.append((n, state))
                elif n >= self.chunk:  # (the first batch draws from the epoch's recorded state)
                    before = torch.get_rng_state()
            try:
                item = next(it)
            except StopIteration:
                item = _END
            if item is _END or n % self.chunk == self.chunk - 1:
                if live is not None:
                    torch.set_rng_state(live)
                elif before is not None and not torch.equal(before, torch.get_rng_state()):
                    self._record(n - n % self.chunk, before)
                live = before = None
            if item is _END:
                return
            n += 1
            yield item

    def _record(self, index: int, state: torch.Tensor) -> None:
        if len(self.lazy) < self.MAX_LAZY:
            self.lazy.append((index, state))
        elif not self.overflowed:
            self.overflowed = True
            warnings.warn(
                f"lightning-snapshot: the train loader's sampler ({type(self.inner).__name__}) draws from the global"
                f" torch RNG as it yields, more than {self.MAX_LAZY} times an epoch: a resume within an epoch will not"
                " replay its order exactly. Draw the epoch's order when its iteration starts, or give the sampler a"
                " torch.Generator of its own",
                stacklevel=2,
            )

    def _set_epoch(self, pending: dict[str, Any]) -> None:
        epoch = pending.get("sampler_epoch")
        order = (pending.get("global") or {}).get("order") or {}
        if epoch is None and order.get("kind") == "distributed":  # (a position of an older version)
            epoch = order.get("epoch")
        if epoch is not None and callable(getattr(self.inner, "set_epoch", None)):
            self.inner.set_epoch(int(epoch))
        self.sampler_epoch = epoch_of(self.inner)

    def global_position(self, consumed_batches: int, batch_size: int) -> dict[str, Any] | None:
        """The global position after this rank consumed ``consumed_batches`` batches of the epoch (loop count)."""
        if self.order is None:
            return None
        local = self.offset + max(0, consumed_batches - self.start_batches) * batch_size
        samples = min(self.order["n"], self.base + local * self.replicas)
        return {"order": self.order, "base": self.base, "samples": samples, "replicas": self.replicas}


class DrawRecorder(_Wrapper):
    """Transparent wrapper of the index sampler of a loader Lightning restores itself (``state_dict`` /
    ``load_state_dict``, e.g. torchdata's ``StatefulDataLoader``) when that sampler keeps no state of its own.

    Such a loader is restored by fast-forwarding its sampler by the number of indices it had given, which replays the
    epoch's order only if the sampler draws it from the same RNG state. Under DDP, Lightning wraps a sampler that is
    not torch's own (torchdata's ``RandomSampler``) in its ``DistributedSamplerWrapper``, whose order is drawn from
    the global torch RNG when the epoch's first index is asked for. This records the RNG state of each draw
    (:attr:`draw_rng`); a resumed run replays the interrupted epoch's draw from it (:attr:`replay`, set before the
    loader's first iterator), forked: the global RNG is put back right after the draw.
    """

    _OWN = ("inner", "draw_rng", "replay", "draws")

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        #: The torch RNG state the current epoch's order was drawn from (None before the first draw).
        self.draw_rng: torch.Tensor | None = None
        self.replay: torch.Tensor | None = None
        self.draws = 0

    def __iter__(self) -> Iterator[int]:
        self.draws += 1
        replay, self.replay = self.replay, None
        if replay is None:
            self.draw_rng = torch.get_rng_state()
            yield from self.inner
            return
        outer = torch.get_rng_state()
        try:
            torch.set_rng_state(replay)
            self.draw_rng = replay
            it = iter(self.inner)
            head = list(itertools.islice(it, 1))  # samplers draw their order when the first index is asked for
        finally:
            torch.set_rng_state(outer)
        yield from head
        yield from it


_END = object()
#: torch's samplers, which draw from the global RNG only when their iteration starts (or not at all).
_TORCH_SAMPLERS = (RandomSampler, SequentialSampler, DistributedSampler, SubsetRandomSampler, WeightedRandomSampler)


def _lazy_records(value: Any) -> dict[int, torch.Tensor]:
    """The ``lazy`` entries of a saved position (:attr:`ResumableSampler.lazy`), checked: an entry that is not an
    item index and a torch RNG state is left out, with a warning (that batch is then taken from the live RNG)."""
    records: dict[int, torch.Tensor] = {}
    size = torch.get_rng_state().numel()
    for entry in value if isinstance(value, (list, tuple)) else []:
        index, state = entry if isinstance(entry, (list, tuple)) and len(entry) == 2 else (None, None)
        if (
            isinstance(index, int)
            and not isinstance(index, bool)
            and index >= 0
            and isinstance(state, torch.Tensor)
            and state.dtype == torch.uint8
            and state.numel() == size
        ):
            records[index] = state
        else:
            warnings.warn(
                "lightning-snapshot: a saved data position holds a malformed RNG record of the train sampler; it is"
                " left out, so that batch's order may differ from the interrupted run's",
                stacklevel=3,
            )
    return records


def resumable_of(loader: DataLoader) -> ResumableSampler:
    """The :class:`ResumableSampler` of a loader :func:`install` wrapped: in its torch ``BatchSampler``, or its
    batch sampler of the user's own, wrapped whole (torch types ``batch_sampler`` as any iterable of batches)."""
    return cast(ResumableSampler, index_wrapper_of(loader))


def index_wrapper_of(loader: Any) -> Any:
    """What :func:`install` put in ``loader``: the whole batch sampler when it wrapped one of the user's own, else the
    index sampler inside its batch sampler (None when there is none)."""
    batch_sampler = getattr(loader, "batch_sampler", None)
    return batch_sampler if isinstance(batch_sampler, ResumableSampler) else getattr(batch_sampler, "sampler", None)
