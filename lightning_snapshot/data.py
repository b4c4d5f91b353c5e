"""Data position for plain ``DataLoader``s: record it, and fast-forward the sampler on resume.

Lightning restores the position only of loaders that have ``state_dict``/``load_state_dict`` (torchdata's
``StatefulDataLoader``). A plain ``DataLoader`` resumed mid-epoch starts again at sample 0 and redraws its shuffle
order. We wrap the index sampler inside its ``BatchSampler`` with :class:`ResumableSampler`, which records the RNG
state from which the epoch's order is drawn, and on resume replays that draw and skips the indices of the batches
already consumed. The skipped samples are never loaded: only their indices are drawn. A batch sampler of the user's
own is wrapped whole, its batches skipped. A sampler that is not torch's own may draw from the global RNG as it
yields (a bucketing sampler that shuffles each bucket when it reaches it): its batches are followed, and each batch
whose taking drew is recorded with the RNG state it drew from, for the resumed epoch to take it from that state
(:meth:`ResumableSampler._follow`).

The position is also kept as a *global* sample count: how many samples of the epoch's global order (the order before
it is split over the ranks) all ranks together have consumed, plus what is needed to rebuild that order (the seed
and epoch of a ``DistributedSampler``, the RNG a ``RandomSampler`` drew from). A run resumed with another number of
data-parallel ranks continues the same order from that sample, split over its own ranks the way
``DistributedSampler`` splits an epoch (:func:`split`).

What random augmentation draws is restored too (:class:`_IteratorTracker`, installed with the sampler):

* the RNG each iterator is created from (``iter_rng``): creating a ``DataLoader`` iterator draws the workers' base
  seed from the global torch RNG (or ``loader.generator``), and with workers the sampler's order too. A resumed run
  creates its first iterator from the recorded state, then puts the global RNG back (a fork);
* with ``num_workers > 0`` (persistent or not) every worker sends, with each batch, its torch/python/numpy RNG
  states after producing it (a picklable ``collate_fn`` wrapper; unwrapped in the main process before anyone sees
  the batch). A position records, for each worker, its state after its last batch before the one resumed at; the
  resumed iterator hands batch ``n`` to worker ``n % num_workers`` as the interrupted one did (its round robin is
  rotated), and a ``worker_init_fn`` wrapper sets each resumed worker's RNG after the user's (or Lightning's) init
  function has run. A worker with no batch before ``n`` starts as the replayed base seed and init function make it
  (persistent workers: as their last batch of the earlier epochs left it, batches made ahead and dropped at the end
  of a shortened epoch included; they are reseeded from their original base seed, as ``get_worker_info().seed``
  says). A snapshot at the end of an epoch (:func:`position` with ``ended``) holds the persistent workers' states
  for the next epoch, whose order is drawn when the resumed iterator first needs it.

The wrappers are given to each iterator only (the loader's ``collate_fn`` and ``worker_init_fn`` stay the user's), and
the hooks hold the iterator weakly, so a dropped iterator still shuts its workers down at once. Torch internals used:
``DataLoader._get_iterator``, and of ``_MultiProcessingDataLoaderIter`` its ``_get_data``, ``_next_data``,
``_reset``, ``_try_put_index``, ``_worker_queue_idx_cycle``, ``_sampler_iter`` and ``_base_seed``; in the worker,
``_generate_state`` and ``_worker_info`` (as in torch 2.13).
"""

from __future__ import annotations

import itertools
import logging
import math
import random
import warnings
import weakref
from collections import deque
from collections.abc import Iterator, Mapping
from typing import Any, cast

import numpy as np
import torch
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    Dataset,
    DistributedSampler,
    IterableDataset,
    RandomSampler,
    Sampler,
    SequentialSampler,
    SubsetRandomSampler,
    WeightedRandomSampler,
    get_worker_info,
)

__all__ = [
    "DrawRecorder",
    "ResumableSampler",
    "describe_order",
    "flatten_loaders",
    "global_order",
    "install",
    "is_stateful",
    "plan_resume",
    "position",
    "split",
    "unsupported_reason",
]

log = logging.getLogger(__name__)


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
        #: :meth:`_IteratorTracker.get_iterator`).
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
        self.replicas = _replicas(self.inner)[0]
        gen = self._generator()
        if pending is None:
            self.epoch_state = (torch.get_rng_state(), gen.get_state() if gen is not None else None)
            self.order = describe_order(self.inner, *self.epoch_state)
            self.sampler_epoch = _epoch_of(self.inner)
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
        self.sampler_epoch = _epoch_of(self.inner)

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


def _epoch_of(sampler: Any) -> int | None:
    epoch = getattr(sampler, "epoch", None)
    return epoch if isinstance(epoch, int) and not isinstance(epoch, bool) else None


def _is_plain_distributed(sampler: Any) -> bool:
    return isinstance(sampler, DistributedSampler) and type(sampler).__iter__ is DistributedSampler.__iter__


def _replicas(sampler: Any) -> tuple[int, int, bool]:
    """(data-parallel ranks, this rank, drop_last) of an index sampler: a DistributedSampler's, else (1, 0, False)."""
    if isinstance(sampler, DistributedSampler):
        return int(sampler.num_replicas), int(sampler.rank), bool(sampler.drop_last)
    return 1, 0, False


def describe_order(sampler: Any, rng: torch.Tensor, gen: torch.Tensor | None) -> dict[str, Any] | None:
    """What rebuilds the global order of the epoch ``sampler`` is about to draw (``rng``/``gen``: the torch RNG
    and the sampler generator state it draws from), or None for samplers whose order cannot be rebuilt.

    * torch's ``DistributedSampler`` (what Lightning injects under DDP and ModelParallel): ``randperm(n)`` seeded
      with ``seed + epoch``, or ``range(n)`` without shuffling; independent of the number of ranks.
    * ``SequentialSampler``: ``range(n)``.
    * ``RandomSampler`` without replacement: the permutation drawn from the recorded RNG or generator state.
    """
    if _is_plain_distributed(sampler):
        return {
            "kind": "distributed",
            "n": len(sampler.dataset),
            "shuffle": bool(sampler.shuffle),
            "seed": int(sampler.seed),
            "epoch": int(sampler.epoch),
        }
    if type(sampler) is SequentialSampler:
        return {"kind": "sequential", "n": len(sampler.data_source)}
    if type(sampler) is RandomSampler and not sampler.replacement and sampler.num_samples == len(sampler.data_source):
        return {"kind": "random", "n": len(sampler.data_source), "rng": rng, "gen": gen}
    return None


def global_order(order: dict[str, Any]) -> list[int]:
    """The epoch's global order of sample indices described by :func:`describe_order`; the RNG is left untouched."""
    n = int(order["n"])
    kind = order["kind"]
    if kind == "sequential" or (kind == "distributed" and not order["shuffle"]):
        return list(range(n))
    if kind == "distributed":
        g = torch.Generator()
        g.manual_seed(int(order["seed"]) + int(order["epoch"]))
        return torch.randperm(n, generator=g).tolist()
    if kind == "random":
        with torch.random.fork_rng(devices=[]):
            gen = None
            if order.get("gen") is not None:
                gen = torch.Generator()
                gen.set_state(order["gen"])
            else:
                torch.set_rng_state(order["rng"])
            return list(RandomSampler(range(n), generator=gen))
    raise ValueError(f"unknown order kind {kind!r}")


def split(order: list[int], start: int, replicas: int, rank: int, drop_last: bool) -> list[int]:
    """Rank ``rank``'s share of ``order[start:]`` split over ``replicas`` ranks exactly as ``DistributedSampler``
    splits an epoch: element ``start + j`` goes to rank ``j % replicas``. A remainder that does not divide is padded
    by repeating the first elements of ``order[start:]`` (every rank gets the same count), or dropped with
    ``drop_last``. ``split(order, 0, ...)`` is what ``DistributedSampler`` itself yields.
    """
    rest = list(order[start:])
    if drop_last:
        total = len(rest) // replicas * replicas
        rest = rest[:total]
    else:
        total = math.ceil(len(rest) / replicas) * replicas
        pad = total - len(rest)
        if pad and rest:
            rest += (rest * math.ceil(pad / len(rest)))[:pad]
    return rest[rank:total:replicas]


def plan_resume(sampler: ResumableSampler, loader: Any, pending: dict[str, Any], exact: bool, epoch: int) -> int | None:
    """Prepare ``sampler`` to continue from the saved position ``pending`` (:func:`position` of the saving rank).

    ``exact``: this rank's own position was restored with its RNG (same world size), so when the order is split
    the same way (same kind of sampler, same number of data-parallel ranks) the sampler replays the epoch exactly,
    bit for bit. Otherwise the epoch continues from the saved *global* sample over the current ranks
    (:func:`split`) and the number of batches the loop should count as consumed is returned, so that the loop's
    count plus the batches left in this rank's stream is the loader's length; None when nothing changes for the loop.

    The loader's next iterator starts as the interrupted one did (exact only: the RNG it was started from, its
    workers' RNG states and round robin); persistent workers left from an earlier ``fit`` are shut down first.
    Call before that iterator is created.
    """
    tracker = _tracker(loader)
    _drop_persistent_iterator(loader)
    consumed = int(pending.get("consumed_batches") or 0)
    # (a position of an older version has no "drawn": it was taken after the draw)
    if not pending.get("drawn", True):
        # the epoch's order is not drawn yet: the sampler draws it afresh (from the RNG the callback restores before
        # the first fetch); the iterator starts from what the interrupted one started from
        if tracker is not None and exact:
            tracker.plan = {"iter_rng": pending.get("iter_rng"), "workers": pending.get("workers"), "start": consumed}
        return None
    saved = pending.get("global")
    replicas, rank, drop_last = _replicas(sampler.inner)
    current = describe_order(sampler.inner, torch.get_rng_state(), None)
    same_split = (
        saved is not None
        and current is not None
        and saved["order"]["kind"] == current["kind"]
        and saved["base"] == 0
        and saved["replicas"] == replicas
    )
    if exact and pending.get("rng") is not None and (saved is None or same_split):
        sampler.pending = pending
        if tracker is not None:
            tracker.plan = {"iter_rng": pending.get("iter_rng"), "workers": pending.get("workers"), "start": consumed}
        return None
    start = _plan_layout_change(sampler, loader, pending, epoch, saved, replicas, rank, drop_last)
    if tracker is not None:  # (no RNG to replay on another layout; batches counted from where the loop is)
        tracker.plan = {"iter_rng": None, "workers": None, "start": consumed if start is None else start}
    return start


def _drop_persistent_iterator(loader: Any) -> None:
    """Shut down the persistent workers of an earlier ``fit`` before a resume (they would carry on as they are)."""
    it = getattr(loader, "_iterator", None)
    if it is not None:
        it._shutdown_workers()
        loader._iterator = None


def _plan_layout_change(
    sampler: ResumableSampler,
    loader: Any,
    pending: dict[str, Any],
    epoch: int,
    saved: dict[str, Any] | None,
    replicas: int,
    rank: int,
    drop_last: bool,
) -> int | None:
    """:func:`plan_resume` on another layout: continue the saved global order over this rank's split."""
    if saved is None:
        warnings.warn(
            "lightning-snapshot: the saved run's sampler cannot be replayed on another number of"
            " processes (only DistributedSampler, RandomSampler and SequentialSampler orders can):"
            " the interrupted epoch's data restarts from the new sampler's order",
            stacklevel=3,
        )
        return None
    batch_size = loader.batch_sampler.batch_size
    length = len(loader.batch_sampler)
    if pending["epoch"] != epoch:
        # taken at the last batch of an epoch: the next epoch starts from its beginning, on the new sampler
        return length
    order = global_order(saved["order"])
    if saved["replicas"] == replicas:
        # the same split, continued (e.g. an epoch that was itself resumed on this layout)
        base, offset = saved["base"], (saved["samples"] - saved["base"]) // replicas
    else:
        base, offset = saved["samples"], 0
    stream = split(order, base, replicas, rank, drop_last)[offset:]
    left = len(stream) // batch_size if loader.batch_sampler.drop_last else math.ceil(len(stream) / batch_size)
    start = max(0, length - left)
    sampler.order, sampler.replicas, sampler.base, sampler.offset = saved["order"], replicas, base, offset
    sampler.start_batches = start
    sampler.stream = stream
    sampler.epoch_state = None
    return start


def flatten_loaders(obj: Any) -> list[Any]:
    """The loaders inside what ``trainer.train_dataloader`` returns (a loader, or dicts/lists of them)."""
    if isinstance(obj, Mapping):
        return [x for v in obj.values() for x in flatten_loaders(v)]
    if isinstance(obj, (list, tuple)):
        return [x for v in obj for x in flatten_loaders(v)]
    return [] if obj is None else [obj]


def is_stateful(loader: Any) -> bool:
    """Whether Lightning itself saves and restores this loader's position (it has state_dict/load_state_dict)."""
    return callable(getattr(loader, "state_dict", None)) and callable(getattr(loader, "load_state_dict", None))


def dataset_generators(dataset: Any) -> list[str]:
    """The random generators a dataset holds as attributes (``torch.Generator``, numpy ``Generator`` or
    ``RandomState``, ``random.Random``), by attribute path, itself or a dataset it wraps (``Subset``,
    ``ConcatDataset``); empty for a dataset that keeps its own state (``state_dict``)."""
    found: list[str] = []

    def visit(obj: Any, path: str, depth: int) -> None:
        if depth > 3 or callable(getattr(obj, "state_dict", None)):
            return
        for attr, value in getattr(obj, "__dict__", {}).items():
            if isinstance(value, (torch.Generator, np.random.Generator, np.random.RandomState, random.Random)):
                found.append(path + attr)
            elif attr == "dataset" and isinstance(value, Dataset):
                visit(value, f"{path}{attr}.", depth + 1)
            elif attr == "datasets" and isinstance(value, (list, tuple)):
                for i, inner in enumerate(value):
                    visit(inner, f"{path}{attr}[{i}].", depth + 1)

    visit(dataset, "", 0)
    return found


def unsupported_reason(loader: Any) -> str | None:
    """Why the position of ``loader`` cannot be restored exactly, or None when it can."""
    if is_stateful(loader):
        return None
    if isinstance(loader, DataLoader) and isinstance(loader.dataset, IterableDataset):
        return (
            "it iterates an IterableDataset that has no state: a resumed run restarts that dataset from its"
            " beginning. Use torchdata.stateful_dataloader.StatefulDataLoader with a dataset that implements"
            " state_dict()/load_state_dict(), or make the dataset resume by itself"
        )
    if not isinstance(loader, DataLoader):
        return (
            f"it is a {type(loader).__name__}, not a torch DataLoader, and has no state_dict()/load_state_dict():"
            " give it those methods so its position can be saved"
        )
    if loader.batch_sampler is None:
        return (
            "it has batch_size=None (no batch sampler): give it a batch_size or a batch_sampler, or use torchdata's"
            " StatefulDataLoader"
        )
    return None


def install(loader: Any) -> ResumableSampler | None:
    """Wrap the index sampler of a plain map-style ``DataLoader`` and follow its iterators (:class:`_IteratorTracker`)
    (idempotent); None when not applicable. The loader's own attributes (``collate_fn``, ``worker_init_fn``) are left
    as they are: the wrappers are given to each iterator's workers only. The stateless index sampler of a loader
    Lightning restores itself gets a :class:`DrawRecorder` (None is returned)."""
    if is_stateful(loader):
        batch_sampler: Any = getattr(loader, "batch_sampler", None)
        sampler = getattr(batch_sampler, "sampler", None)
        if (
            sampler is not None
            and not isinstance(sampler, (DrawRecorder, SequentialSampler))
            and not callable(getattr(sampler, "state_dict", None))
            # torchdata's own samplers keep their state in their iterators, which the loader saves
            and not type(sampler).__module__.startswith("torchdata.")
        ):
            batch_sampler.sampler = DrawRecorder(sampler)
        return None
    if unsupported_reason(loader) is not None:
        return None
    batch_sampler = loader.batch_sampler
    if not isinstance(batch_sampler, (BatchSampler, ResumableSampler)):
        # a batch sampler of the user's own (bucketing by length, ...): it is wrapped whole, and a resumed epoch
        # replays its draw and skips the batches trained on. (DataLoader refuses to set batch_sampler once made.)
        object.__setattr__(loader, "batch_sampler", ResumableSampler(batch_sampler, batches=True))
    elif isinstance(batch_sampler, BatchSampler) and not isinstance(batch_sampler.sampler, ResumableSampler):
        batch_sampler.sampler = ResumableSampler(batch_sampler.sampler, chunk=batch_sampler.batch_size)
    if _tracker(loader) is None:
        loader._get_iterator = _IteratorTracker(loader).get_iterator
        if loader.num_workers > 0 and getattr(loader, "in_order", True) is False:
            warnings.warn(
                "lightning-snapshot: a train loader with in_order=False hands batches to whichever worker"
                " is free: random augmentation in its workers cannot be resumed exactly",
                stacklevel=2,
            )
    return _resumable(loader)


def own_batches(loader: Any, consumed_batches: int) -> int:
    """The batch index in its own stream of a loader that is one of several train loaders, when the loop has
    consumed ``consumed_batches``: in a ``CombinedLoader`` a shorter loader runs out and starts again within the
    epoch (``max_size_cycle``), or stops (``max_size``), so its current iterator is not at the loop's count.
    The loop's count for a loader that is not followed (or before its first iterator)."""
    tracker = _tracker(loader)
    if tracker is None or not tracker.started:
        return consumed_batches
    return tracker.offset + tracker.yielded


def position(loader: Any, epoch: int, consumed_batches: int, *, ended: bool = False) -> dict[str, Any] | None:
    """The position of a wrapped loader before the batch ``consumed_batches`` of ``epoch`` is fetched (the loop's
    count): None before its first iterator exists.

    Keys: ``epoch``, ``consumed_batches``, ``skip`` (samples to skip); ``drawn``: whether the epoch's order was drawn
    already (without workers it is drawn at the first fetch, from the RNG the resumed run restores right before it);
    ``rng``/``gen``: the RNG the order was drawn from (this rank's exact position); ``global``: the global sample
    count with what rebuilds the order (None before the draw); ``iter_rng``: what the epoch's iterator was started
    from (:class:`_IteratorTracker`); ``workers``: the loader workers' RNG states before that batch, or None.

    ``ended``: the loader's last epoch has ended and ``epoch`` is the next one, whose iterator does not exist yet
    (a snapshot at the end of training); only persistent workers carry something (their RNG) into it.
    """
    sampler = _index_wrapper(loader)
    if isinstance(sampler, DrawRecorder):  # (Lightning keeps the rest of this loader's position)
        draw = sampler.draw_rng if not ended and sampler.draws else None
        return {"epoch": epoch, "consumed_batches": consumed_batches, "draw_rng": draw} if draw is not None else None
    if not isinstance(sampler, ResumableSampler):
        return None
    tracker = _tracker(loader)
    started = tracker is not None and tracker.started
    if not started and sampler.epoch_state is None and sampler.order is None:
        return None
    # an iterator that ran out belongs to the epoch before: nothing of the epoch asked for exists yet
    current = tracker is not None and started and not ended and not (tracker.exhausted and consumed_batches == 0)
    drawn = current and tracker is not None and sampler.draws > tracker.draws_at_start
    rng, gen = sampler.epoch_state if drawn and sampler.epoch_state is not None else (None, None)
    batch_size = 1 if sampler.batches else loader.batch_sampler.batch_size  # (skip counts what the sampler yields)
    iter_rng = tracker.start_rng if current and tracker is not None else None
    return {
        "epoch": epoch,
        "consumed_batches": consumed_batches,
        "skip": consumed_batches * batch_size,
        "rng": rng,
        "gen": gen,
        "global": sampler.global_position(consumed_batches, batch_size) if drawn else None,
        "sampler_epoch": sampler.sampler_epoch if drawn else None,
        "drawn": drawn,
        "lazy": [[index, state] for index, state in sampler.lazy] if drawn and sampler.lazy else None,
        "iter_rng": dict(iter_rng) if iter_rng is not None else None,
        "workers": tracker.workers_position(consumed_batches, current) if tracker is not None else None,
    }


# --------------------------------------------------------------------------------------- iterators and workers


def _rng_now() -> tuple[bytes, Any, Any]:
    """This process's torch CPU, python and numpy global RNG states, compact (sent with every worker batch)."""
    return torch.get_rng_state().numpy().tobytes(), random.getstate(), np.random.get_state()


def _rng_dict(compact: tuple[bytes, Any, Any]) -> dict[str, Any]:
    """:func:`_rng_now` output in the form of :func:`lightning_snapshot.capture.capture_rng`."""
    torch_state, python, numpy = compact
    return {"torch": torch.frombuffer(bytearray(torch_state), dtype=torch.uint8), "python": python, "numpy": numpy}


class _Batch:
    """A batch made by a loader worker, with the worker's id and its RNG states right after making it."""

    def __init__(self, data: Any, worker: int, rng: Any) -> None:
        self.data = data
        self.worker = worker
        self.rng = rng

    def pin_memory(self, device: Any = None) -> _Batch:
        """What torch's pin-memory thread calls: pin the batch, keep the rest."""
        from torch.utils.data._utils.pin_memory import pin_memory

        return _Batch(pin_memory(self.data, device), self.worker, self.rng)


class _Collate:
    """The loader's ``collate_fn`` as its workers run it: the user's batch, wrapped with the worker's RNG states.

    Picklable when the user's function is (the ``spawn`` start method pickles it to the workers)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def __call__(self, samples: Any) -> Any:
        data = self.inner(samples)
        info = get_worker_info()
        return data if info is None else _Batch(data, info.id, _rng_now())


class _WorkerInit:
    """The loader's ``worker_init_fn`` for the workers of a resumed iterator: reseed from the interrupted run's base
    seed where this iterator drew another one (persistent workers started in an earlier epoch), run the user's (or
    Lightning's) function, then set the RNG states the worker had before the first resumed batch."""

    def __init__(self, inner: Any, states: list[Any] | None, base_seed: int | None) -> None:
        self.inner = inner
        self.states = states
        self.base_seed = base_seed

    def __call__(self, worker_id: int) -> None:
        if self.base_seed is not None:
            _reseed_worker(worker_id, self.base_seed)
        if self.inner is not None:
            self.inner(worker_id)
        state = self.states[worker_id] if self.states is not None else None
        if state is not None:
            from lightning_snapshot.capture import restore_rng

            restore_rng(state)


def _reseed_worker(worker_id: int, base_seed: int) -> None:
    """Seed this worker as torch seeds a worker of base seed ``base_seed`` (torch's ``_worker_loop``), including
    what ``get_worker_info().seed`` and ``torch.initial_seed()`` say; nothing when it already is."""
    from torch.utils.data._utils import worker as _worker

    info = get_worker_info()
    seed = base_seed + worker_id
    if info is None or info.seed == seed:
        return
    random.seed(seed)
    torch.manual_seed(seed)
    np.random.seed(_worker._generate_state(base_seed, worker_id))
    _worker._worker_info = _worker.WorkerInfo(id=info.id, num_workers=info.num_workers, seed=seed, dataset=info.dataset)


class _IteratorTracker:
    """Follows the iterators of one loader (installed as the loader's ``_get_iterator``) and the RNG states its
    workers had after each batch; starts a resumed iterator where the interrupted one was (see the module doc).

    Holds the loader and the current iterator weakly: a dropped iterator shuts its workers down as before.
    """

    #: Batches kept per worker (those fetched ahead of the loop are at most the loader's prefetch plus a few).
    KEEP = 16

    def __init__(self, loader: DataLoader) -> None:
        self._loader = weakref.ref(loader)
        self._iterator: Any = None
        #: What :func:`plan_resume` set for the next iterator: iter_rng, workers, start (batch index); or None.
        self.plan: dict[str, Any] | None = None
        self.started = False
        self.exhausted = False
        self.draws_at_start = 0
        #: The RNG the current epoch's iterator was started from (``created``: it was created then, drawing the
        #: workers' base seed; False: persistent workers were reset for another epoch).
        self.start_rng: dict[str, Any] | None = None
        self.base_seed: int | None = None
        self.num_workers = 0
        #: Loop batch index of the current iterator's first batch (a resumed epoch starts past 0).
        self.offset = 0
        #: Batches the current iterator has given out.
        self.yielded = 0
        #: Per worker: its states at the start of the current epoch (None: as seeding and init function make it),
        #: the newest it sent, and (batch index, state) of the current epoch's batches received.
        self.carried: list[Any] = []
        self.latest: list[Any] = []
        self.history: list[deque[tuple[int, Any]]] = []
        self.evicted: list[int] = []
        self._draining = False
        #: A resumed iterator whose prefetching starts at its first batch (see get_iterator), or None.
        self._deferred: Any = None

    def __reduce__(self) -> tuple[Any, ...]:
        return _IteratorTracker, (self._loader(),)

    # -------------------------------------------------------------------------------------- iterator start
    def get_iterator(self) -> Any:
        """``DataLoader._get_iterator`` with the tracking wrappers, and the resume plan applied once."""
        loader = self._loader()
        if loader is None:  # (called by the loader's own _get_iterator)
            raise ReferenceError("lightning-snapshot: the tracked DataLoader no longer exists")
        plan, self.plan = self.plan or {}, None
        workers = int(loader.num_workers)
        wplan = plan.get("workers")
        if wplan is not None and int(wplan["num_workers"]) != workers:
            warnings.warn(
                f"lightning-snapshot: the train loader had {wplan['num_workers']} workers, now {workers}:"
                " random augmentation in its workers is not resumed exactly",
                stacklevel=3,
            )
            wplan = None
        replay = plan.get("iter_rng")
        gen = loader.generator if isinstance(loader.generator, torch.Generator) else None
        live = _rng_of(gen)
        # resumed workers are held back until they are started as the interrupted ones were (_prime)
        hold = workers > 0 and wplan is not None
        if replay is not None:
            _set_rng_of(gen, replay)
        draws = _resumable(loader).draws
        it = self._create(loader, wplan, hold)
        if hold:
            if replay is None:
                _set_rng_of(gen, live)  # (undo the base seed draw: the workers are reseeded to the saved one)
            elif not replay.get("created", True):
                _set_rng_of(gen, replay)  # persistent workers were only reset then: no base seed was drawn
            if _resumable(loader).pending is not None:
                self._prime(it, int(plan.get("start") or 0) % workers)
            else:
                # the epoch's order is not drawn yet (a snapshot at the end of an epoch): it is drawn when the first
                # batch is asked for, or when Lightning starts the epoch again (its restored RNG is set by then)
                self._deferred = weakref.ref(it)
        if replay is not None:
            torch.set_rng_state(live["torch"])  # a fork: the callback restores the global RNG before the fetch
        self._started(it, replay if replay is not None else dict(live, created=not hold), draws, workers)
        self.offset = int(plan.get("start") or 0)
        if wplan is not None:
            self.carried = list(wplan["states"])
            if wplan.get("base_seed") is not None:
                self.base_seed = int(wplan["base_seed"])
        return it

    @staticmethod
    def _create(loader: DataLoader, wplan: dict[str, Any] | None, hold: bool) -> Any:
        """The loader's own iterator, its workers given the wrappers (the loader's attributes are put back)."""
        sampler = _resumable(loader)
        collate, init = loader.collate_fn, loader.worker_init_fn
        try:
            if loader.num_workers > 0:
                loader.collate_fn = _Collate(collate)
                if wplan is not None:
                    loader.worker_init_fn = _WorkerInit(init, list(wplan["states"]), wplan.get("base_seed"))
            sampler.hold = hold
            return type(loader)._get_iterator(loader)
        finally:
            sampler.hold = False
            loader.collate_fn, loader.worker_init_fn = collate, init

    @staticmethod
    def _prime(it: Any, first_worker: int) -> None:
        """Start a resumed iterator's prefetching (held back while it was created): its round robin rotated so that
        the epoch's batch ``n`` goes to worker ``n % num_workers`` as in the interrupted iterator."""
        k = it._num_workers
        it._sampler_iter = iter(it._index_sampler)
        it._worker_queue_idx_cycle = itertools.cycle([(first_worker + i) % k for i in range(k)])
        for _ in range(it._prefetch_factor * k):
            it._try_put_index()

    def _started(self, it: Any, start_rng: dict[str, Any], draws: int, workers: int) -> None:
        self._iterator = weakref.ref(it)
        self.base_seed = int(it._base_seed) if workers > 0 else None
        self.started, self.exhausted = True, False
        self.yielded = 0
        self.start_rng = start_rng
        self.draws_at_start = draws
        self.num_workers = workers
        self.carried = [None] * workers
        self.latest = [None] * workers
        self.history = [deque(maxlen=self.KEEP) for _ in range(workers)]
        self.evicted = [-1] * workers
        _hook(it, "_next_data", self._next_data)
        if workers > 0:
            _hook(it, "_get_data", self._get_data)
            if it._persistent_workers:
                _hook(it, "_reset", self._reset)

    def _reset(self, it: Any, original: Any, loader: Any, first_iter: bool = False) -> None:
        """A persistent iterator started for another epoch: its workers carry their RNG into it."""
        sampler = _resumable(loader)
        gen = loader.generator if isinstance(loader.generator, torch.Generator) else None
        start_rng = dict(_rng_of(gen), created=False)
        draws = sampler.draws
        self._deferred = None  # (the reset starts its prefetching)
        self._draining = True
        try:
            original(it, loader, first_iter)  # (takes in what the workers made past the end of the last epoch)
        finally:
            self._draining = False
        latest = list(self.latest)
        carried = [s if s is not None else c for s, c in zip(latest, self.carried, strict=True)]
        self.started, self.exhausted = True, False
        self.yielded = 0
        self.start_rng = start_rng
        self.draws_at_start = draws
        self.offset = 0
        self.carried, self.latest = carried, [None] * self.num_workers
        self.history = [deque(maxlen=self.KEEP) for _ in range(self.num_workers)]
        self.evicted = [-1] * self.num_workers

    # -------------------------------------------------------------------------------------- batches
    def _next_data(self, it: Any, original: Any) -> Any:
        if self._deferred is not None and self._deferred() is it:
            self._deferred = None
            self._prime(it, self.offset % self.num_workers)
        try:
            batch = original(it)
        except StopIteration:
            if self._is_current(it):
                self.exhausted = True
            raise
        if self._is_current(it):
            self.yielded += 1
        return batch

    def _get_data(self, it: Any, original: Any) -> Any:
        """Unwrap a worker's batch as it reaches the main process (before anyone sees it) and keep its RNG."""
        idx, data = original(it)
        if isinstance(data, _Batch):
            if self._is_current(it):
                self._record(data.worker, idx, data.rng)
            data = data.data
        return idx, data

    def _is_current(self, it: Any) -> bool:
        return self._iterator is not None and self._iterator() is it

    def _record(self, worker: int, idx: int, rng: Any) -> None:
        self.latest[worker] = rng
        if self._draining:  # a batch of the epoch before, made ahead and dropped
            return
        history = self.history[worker]
        if len(history) == history.maxlen:
            self.evicted[worker] = max(self.evicted[worker], history[0][0])
        history.append((self.offset + idx, rng))

    def workers_position(self, consumed: int, current: bool) -> dict[str, Any] | None:
        """Each worker's RNG states after its last batch before batch ``consumed`` of the epoch (None: as seeding
        and the init function make it), or None without workers (or before a non-persistent epoch's iterator)."""
        loader = self._loader()
        if self.num_workers == 0 or loader is None or getattr(loader, "in_order", True) is False:
            return None
        persistent = bool(loader.persistent_workers)
        if not current:
            if not persistent:
                return None  # the next epoch's workers do not exist yet
            states = [s if s is not None else c for s, c in zip(self.latest, self.carried, strict=True)]
        else:
            states = []
            for w in range(self.num_workers):
                before = [s for i, s in self.history[w] if i < consumed]
                if before:
                    states.append(before[-1])
                elif self.evicted[w] >= 0 and self.evicted[w] < consumed:
                    log.warning(
                        "lightning-snapshot: loader worker %d's RNG state before batch %d is no longer"
                        " known; its augmentation will not resume exactly",
                        w,
                        consumed,
                    )
                    states.append(None)
                else:
                    states.append(self.carried[w])
        return {
            "num_workers": self.num_workers,
            "persistent": persistent,
            "base_seed": self.base_seed,
            "states": [_rng_dict(s) if isinstance(s, tuple) else s for s in states],
        }


def _rng_of(gen: torch.Generator | None) -> dict[str, Any]:
    return {"torch": torch.get_rng_state(), "gen": gen.get_state() if gen is not None else None}


def _set_rng_of(gen: torch.Generator | None, state: Mapping[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    if gen is not None and state.get("gen") is not None:
        gen.set_state(state["gen"])


def _hook(it: Any, name: str, wrapper: Any) -> None:
    """Route ``it.name(...)`` through ``wrapper(it, original, ...)``, holding ``it`` weakly (an iterator that is
    dropped still shuts its workers down at once)."""
    ref = weakref.ref(it)
    original = getattr(type(it), name)

    def hooked(*args: Any, **kwargs: Any) -> Any:
        return wrapper(ref(), original, *args, **kwargs)

    setattr(it, name, hooked)


def _resumable(loader: DataLoader) -> ResumableSampler:
    """The :class:`ResumableSampler` of a loader :func:`install` wrapped: in its torch ``BatchSampler``, or its
    batch sampler of the user's own, wrapped whole (torch types ``batch_sampler`` as any iterable of batches)."""
    return cast(ResumableSampler, _index_wrapper(loader))


def _index_wrapper(loader: Any) -> Any:
    """What :func:`install` put in ``loader``: the whole batch sampler when it wrapped one of the user's own, else the
    index sampler inside its batch sampler (None when there is none)."""
    batch_sampler = getattr(loader, "batch_sampler", None)
    return batch_sampler if isinstance(batch_sampler, ResumableSampler) else getattr(batch_sampler, "sampler", None)


def _tracker(loader: Any) -> _IteratorTracker | None:
    """The tracker :func:`install` put on ``loader``, or None."""
    hook = getattr(loader, "__dict__", {}).get("_get_iterator")
    owner = getattr(hook, "__self__", None)
    return owner if isinstance(owner, _IteratorTracker) else None
