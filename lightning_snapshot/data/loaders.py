"""A train loader's position: install the tracking, capture the position, and plan a resume from it.

One job: the data position as the callback sees it. :func:`install` wraps a loader's sampler
(:mod:`~lightning_snapshot.data.samplers`) and follows its iterators (:mod:`~lightning_snapshot.data.workers`);
:func:`position` captures where the loader is (a dict stored with the snapshot); :func:`plan_resume` prepares the
loader to continue from a saved position, on the same layout exactly or on another number of ranks through the
global order (:mod:`~lightning_snapshot.data.order`). Also what tells which loaders can be resumed
(:func:`is_stateful`, :func:`unsupported_reason`, :func:`dataset_generators`). Called by
:mod:`lightning_snapshot.callback` through :mod:`lightning_snapshot.data`.
"""

from __future__ import annotations

import math
import random
import warnings
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from torch.utils.data import BatchSampler, DataLoader, Dataset, IterableDataset, SequentialSampler

from lightning_snapshot.data.order import describe_order, global_order, replicas_of, split
from lightning_snapshot.data.samplers import DrawRecorder, ResumableSampler, index_wrapper_of, resumable_of
from lightning_snapshot.data.workers import IteratorTracker, tracker_of

__all__ = [
    "dataset_generators",
    "flatten_loaders",
    "install",
    "is_stateful",
    "own_batches",
    "plan_resume",
    "position",
    "unsupported_reason",
]


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
    tracker = tracker_of(loader)
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
    replicas, rank, drop_last = replicas_of(sampler.inner)
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
    """Wrap the index sampler of a plain map-style ``DataLoader`` and follow its iterators (:class:`IteratorTracker`)
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
    if tracker_of(loader) is None:
        loader._get_iterator = IteratorTracker(loader).get_iterator
        if loader.num_workers > 0 and getattr(loader, "in_order", True) is False:
            warnings.warn(
                "lightning-snapshot: a train loader with in_order=False hands batches to whichever worker"
                " is free: random augmentation in its workers cannot be resumed exactly",
                stacklevel=2,
            )
    return resumable_of(loader)


def own_batches(loader: Any, consumed_batches: int) -> int:
    """The batch index in its own stream of a loader that is one of several train loaders, when the loop has
    consumed ``consumed_batches``: in a ``CombinedLoader`` a shorter loader runs out and starts again within the
    epoch (``max_size_cycle``), or stops (``max_size``), so its current iterator is not at the loop's count.
    The loop's count for a loader that is not followed (or before its first iterator)."""
    tracker = tracker_of(loader)
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
    from (:class:`IteratorTracker`); ``workers``: the loader workers' RNG states before that batch, or None.

    ``ended``: the loader's last epoch has ended and ``epoch`` is the next one, whose iterator does not exist yet
    (a snapshot at the end of training); only persistent workers carry something (their RNG) into it.
    """
    sampler = index_wrapper_of(loader)
    if isinstance(sampler, DrawRecorder):  # (Lightning keeps the rest of this loader's position)
        draw = sampler.draw_rng if not ended and sampler.draws else None
        return {"epoch": epoch, "consumed_batches": consumed_batches, "draw_rng": draw} if draw is not None else None
    if not isinstance(sampler, ResumableSampler):
        return None
    tracker = tracker_of(loader)
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
