"""Data position for plain ``DataLoader``s: record it, and fast-forward the sampler on resume.

Lightning restores the position only of loaders that have ``state_dict``/``load_state_dict`` (torchdata's
``StatefulDataLoader``). A plain ``DataLoader`` resumed mid-epoch starts again at sample 0 and redraws its shuffle
order. We wrap the index sampler inside its ``BatchSampler`` with :class:`ResumableSampler`, which records the RNG
state from which the epoch's order is drawn, and on resume replays that draw and skips the indices of the batches
already consumed. The skipped samples are never loaded: only their indices are drawn.

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
  (persistent workers: as their last batch of the earlier epochs left it).
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
from typing import Any

import numpy as np
import torch
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler, IterableDataset, RandomSampler, Sampler
from torch.utils.data import SequentialSampler, get_worker_info
from torch.utils.data.dataloader import _MultiProcessingDataLoaderIter

__all__ = [
    "ResumableSampler", "install", "flatten_loaders", "is_stateful", "position", "unsupported_reason", "describe_order",
    "global_order", "split", "plan_resume",
]

log = logging.getLogger(__name__)


class ResumableSampler(Sampler[int]):
    """Transparent wrapper of an index sampler that can replay an epoch's order and skip ahead.

    Attribute access falls through to the wrapped sampler (so Lightning's ``set_epoch`` reaches a
    ``DistributedSampler``).
    """

    _OWN = ("inner", "epoch_state", "pending", "order", "replicas", "base", "offset", "start_batches", "stream",
            "draws", "hold")

    def __init__(self, inner: Any) -> None:
        self.inner = inner
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

    def __len__(self) -> int:
        return len(self.inner)

    def __getattr__(self, name: str) -> Any:
        if name in ResumableSampler._OWN:
            raise AttributeError(name)
        return getattr(self.inner, name)

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
            yield from self.inner
            return
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
            it = iter(self.inner)
            skip = int(pending.get("skip") or 0)
            if skip:  # drop the indices of the batches the interrupted run already trained on
                next(itertools.islice(it, skip, skip), None)
            head = list(itertools.islice(it, 1))  # samplers draw their order when the first index is asked for
        finally:
            torch.set_rng_state(outer)
        yield from head
        yield from it

    def global_position(self, consumed_batches: int, batch_size: int) -> dict[str, Any] | None:
        """The global position after this rank consumed ``consumed_batches`` batches of the epoch (loop count)."""
        if self.order is None:
            return None
        local = self.offset + max(0, consumed_batches - self.start_batches) * batch_size
        samples = min(self.order["n"], self.base + local * self.replicas)
        return {"order": self.order, "base": self.base, "samples": samples, "replicas": self.replicas}


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
        return {"kind": "distributed", "n": len(sampler.dataset), "shuffle": bool(sampler.shuffle),
                "seed": int(sampler.seed), "epoch": int(sampler.epoch)}
    if type(sampler) is SequentialSampler:
        return {"kind": "sequential", "n": len(sampler.data_source)}
    if (type(sampler) is RandomSampler and not sampler.replacement
            and sampler.num_samples == len(sampler.data_source)):
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


def plan_resume(sampler: ResumableSampler, loader: Any, pending: dict[str, Any], exact: bool,
                epoch: int) -> int | None:
    """Prepare ``sampler`` to continue from the saved position ``pending`` (:func:`position` of the saving rank).

    ``exact``: this rank's own position was restored with its RNG (same world size), so when the order is split
    the same way (same kind of sampler, same number of data-parallel ranks) the sampler replays the epoch exactly,
    bit for bit. Otherwise the epoch continues from the saved *global* sample over the current ranks
    (:func:`split`) and the number of batches the loop should count as consumed is returned, so that the loop's
    count plus the batches left in this rank's stream is the loader's length; None when nothing changes for the loop.
    """
    saved = pending.get("global")
    replicas, rank, drop_last = _replicas(sampler.inner)
    current = describe_order(sampler.inner, torch.get_rng_state(), None)
    same_split = (saved is not None and current is not None and saved["order"]["kind"] == current["kind"]
                  and saved["base"] == 0 and saved["replicas"] == replicas)
    if exact and pending.get("rng") is not None and (saved is None or same_split):
        sampler.pending = pending
        return None
    if saved is None:
        warnings.warn("lightning-snapshot: the saved run's sampler cannot be replayed on another number of"
                      " processes (only DistributedSampler, RandomSampler and SequentialSampler orders can):"
                      " the interrupted epoch's data restarts from the new sampler's order", stacklevel=2)
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
    if not isinstance(loader.batch_sampler, BatchSampler):
        return (
            "it has no torch BatchSampler (batch_size=None or a custom batch_sampler): give the loader or its batch"
            " sampler state_dict()/load_state_dict(), or use torchdata's StatefulDataLoader"
        )
    return None


def install(loader: Any) -> ResumableSampler | None:
    """Wrap the index sampler of a plain map-style ``DataLoader`` (idempotent); None when not applicable."""
    if unsupported_reason(loader) is not None or is_stateful(loader):
        return None
    batch_sampler = loader.batch_sampler
    if isinstance(batch_sampler.sampler, ResumableSampler):
        return batch_sampler.sampler
    wrapper = ResumableSampler(batch_sampler.sampler)
    batch_sampler.sampler = wrapper
    return wrapper


def position(loader: Any, epoch: int, consumed_batches: int) -> dict[str, Any] | None:
    """The position of a wrapped loader: epoch, batches consumed and the RNG the epoch's order came from (this
    rank's exact position), and ``global``: the global sample count with what rebuilds the epoch's order."""
    sampler = getattr(getattr(loader, "batch_sampler", None), "sampler", None)
    if not isinstance(sampler, ResumableSampler) or (sampler.epoch_state is None and sampler.order is None):
        return None
    if consumed_batches == 0 and getattr(loader, "num_workers", 0) == 0:
        # the epoch's first batch is not fetched yet: without workers its order is drawn then, from the RNG the
        # resumed run restores right before that fetch (the sampler's recorded state is the previous epoch's)
        return None
    rng, gen = sampler.epoch_state if sampler.epoch_state is not None else (None, None)
    batch_size = loader.batch_sampler.batch_size
    return {
        "epoch": epoch,
        "consumed_batches": consumed_batches,
        "skip": consumed_batches * batch_size,
        "rng": rng,
        "gen": gen,
        "global": sampler.global_position(consumed_batches, batch_size),
    }
