"""The data order arithmetic, pure: which sample comes next, and how an epoch's global order is split over ranks.

One job: describe an epoch's global order from its sampler (:func:`describe_order`), rebuild it from that
description (:func:`global_order`), and split the rest of it over data-parallel ranks as ``DistributedSampler`` does
(:func:`split`). No I/O and no process group: it only reads sampler attributes and computes. Called by
:mod:`~lightning_snapshot.data.samplers` (to record the order an epoch draws) and
:mod:`~lightning_snapshot.data.loaders` (to continue it on another number of ranks).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch.utils.data import DistributedSampler, RandomSampler, SequentialSampler

__all__ = ["describe_order", "epoch_of", "global_order", "replicas_of", "split"]


def epoch_of(sampler: Any) -> int | None:
    """The epoch an index sampler says it is in (a ``DistributedSampler``'s ``epoch``), or None when it has none."""
    epoch = getattr(sampler, "epoch", None)
    return epoch if isinstance(epoch, int) and not isinstance(epoch, bool) else None


def _is_plain_distributed(sampler: Any) -> bool:
    return isinstance(sampler, DistributedSampler) and type(sampler).__iter__ is DistributedSampler.__iter__


def replicas_of(sampler: Any) -> tuple[int, int, bool]:
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
