"""Data position for plain ``DataLoader``s: record it, and fast-forward the sampler on resume.

Lightning restores the position only of loaders that have ``state_dict``/``load_state_dict`` (torchdata's
``StatefulDataLoader``). A plain ``DataLoader`` resumed mid-epoch starts again at sample 0 and redraws its shuffle
order. We wrap the index sampler inside its ``BatchSampler`` with :class:`ResumableSampler`, which records the RNG
state from which the epoch's order is drawn, and on resume replays that draw and skips the indices of the batches
already consumed. The skipped samples are never loaded: only their indices are drawn.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch.utils.data import BatchSampler, DataLoader, IterableDataset, Sampler

__all__ = ["ResumableSampler", "install", "flatten_loaders", "is_stateful", "position", "unsupported_reason"]

log = logging.getLogger(__name__)


class ResumableSampler(Sampler[int]):
    """Transparent wrapper of an index sampler that can replay an epoch's order and skip ahead.

    Attribute access falls through to the wrapped sampler (so Lightning's ``set_epoch`` reaches a
    ``DistributedSampler``).
    """

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        #: (torch RNG state, sampler generator state or None) when the current epoch's order was drawn.
        self.epoch_state: tuple[torch.Tensor, torch.Tensor | None] | None = None
        self.pending: dict[str, Any] | None = None

    def __len__(self) -> int:
        return len(self.inner)

    def __getattr__(self, name: str) -> Any:
        if name in ("inner", "epoch_state", "pending"):
            raise AttributeError(name)
        return getattr(self.inner, name)

    def _generator(self) -> torch.Generator | None:
        gen = getattr(self.inner, "generator", None)
        return gen if isinstance(gen, torch.Generator) else None

    def __iter__(self) -> Iterator[int]:
        pending, self.pending = self.pending, None
        gen = self._generator()
        if pending is not None:
            # replay the RNG from which the interrupted epoch drew its order...
            torch.set_rng_state(pending["rng"])
            if gen is not None and pending.get("gen") is not None:
                gen.set_state(pending["gen"])
        self.epoch_state = (torch.get_rng_state(), gen.get_state() if gen is not None else None)
        it = iter(self.inner)
        if pending is not None and pending["skip"]:
            # ...and drop the indices of the batches the interrupted run already trained on
            next(itertools.islice(it, pending["skip"], pending["skip"]), None)
        yield from it


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
    """The position of a wrapped loader: epoch, batches consumed and the RNG the epoch's order came from."""
    sampler = getattr(getattr(loader, "batch_sampler", None), "sampler", None)
    if not isinstance(sampler, ResumableSampler) or sampler.epoch_state is None:
        return None
    rng, gen = sampler.epoch_state
    return {
        "epoch": epoch,
        "consumed_batches": consumed_batches,
        "skip": consumed_batches * loader.batch_sampler.batch_size,
        "rng": rng,
        "gen": gen,
    }
