"""The data position as a global sample count (lightning_snapshot.data), in process with real samplers and loaders:
the split over ranks is DistributedSampler's own, and a resume on another number of ranks continues the same global
order from the saved sample."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler, RandomSampler, SequentialSampler

from lightning_snapshot import data


def _loader(
    n: int,
    batch_size: int,
    replicas: int | None,
    rank: int = 0,
    *,
    drop_last: bool = False,
    sampler_drop_last: bool = False,
    epoch: int = 0,
    seed: int = 42,
) -> DataLoader:
    """A loader over range(n) as Lightning builds it: a DistributedSampler under DDP, a RandomSampler on one process."""
    ds = list(range(n))
    if replicas is None:
        sampler = RandomSampler(ds)
    else:
        sampler = DistributedSampler(
            ds, num_replicas=replicas, rank=rank, shuffle=True, seed=seed, drop_last=sampler_drop_last
        )
        sampler.set_epoch(epoch)
    loader = DataLoader(ds, batch_size=batch_size, sampler=sampler, drop_last=drop_last)
    assert data.install(loader) is not None
    return loader


def _consume(loader: DataLoader, batches: int) -> list[list[int]]:
    it = iter(loader)
    return [next(it).tolist() for _ in range(batches)]


@pytest.mark.parametrize(
    "n,replicas,drop_last", [(96, 2, False), (90, 4, False), (90, 4, True), (7, 3, False), (2, 5, False)]
)
def test_split_is_distributed_samplers_own(n, replicas, drop_last):
    for epoch in (0, 3):
        order = data.global_order({"kind": "distributed", "n": n, "shuffle": True, "seed": 7, "epoch": epoch})
        for rank in range(replicas):
            s = DistributedSampler(list(range(n)), num_replicas=replicas, rank=rank, seed=7, drop_last=drop_last)
            s.set_epoch(epoch)
            assert data.split(order, 0, replicas, rank, drop_last) == list(s), (epoch, rank)


@pytest.mark.parametrize("new_replicas", [1, 3, 4])
def test_two_ranks_resumed_on_another_number_continue_the_global_order(new_replicas):
    n, batch, consumed = 90, 4, 6
    order = torch.randperm(n, generator=torch.Generator().manual_seed(42)).tolist()  # seed 42 + epoch 0
    saved = []
    for rank in range(2):
        loader = _loader(n, batch, 2, rank)
        seen = _consume(loader, consumed)
        assert [i for b in seen for i in b] == order[rank : 2 * consumed * batch : 2]
        saved.append(data.position(loader, 0, consumed))
    g = saved[0]["global"]
    assert g["samples"] == 2 * consumed * batch == 48 and g["replicas"] == 2
    assert saved[1]["global"] == g  # every rank saves the same global position
    rest = order[48:]  # 42 samples
    got, counts = [], []
    for rank in range(new_replicas):
        loader = _loader(n, batch, new_replicas if new_replicas > 1 else None, rank)
        start = data.plan_resume(loader.batch_sampler.sampler, loader, saved[0], exact=False, epoch=0)
        batches = list(loader)
        assert start + len(batches) == len(loader), "the epoch must end exactly at the loader's length"
        stream = [i for b in batches for i in b.tolist()]
        got.append(stream)
        counts.append(len(stream))
        # DistributedSampler-style striding of the rest of the same permutation, padded with its first samples
        padded = rest + rest[: -len(rest) % new_replicas]
        assert stream == padded[rank::new_replicas]
    assert len(set(counts)) == 1, "every rank gets the same number of samples"
    assert sorted({i for s in got for i in s}) == sorted(rest), "every remaining sample is seen, and only those"
    # the next epoch is the new sampler's own (the loader's DistributedSampler at epoch 1, unchanged)
    assert loader.batch_sampler.sampler.stream is None


def test_remainder_is_dropped_with_drop_last_sampler():
    n, batch = 90, 4
    loader = _loader(n, batch, 2, 0)
    _consume(loader, 6)
    pos = data.position(loader, 0, 6)
    order = torch.randperm(n, generator=torch.Generator().manual_seed(42)).tolist()
    streams = []
    for rank in range(4):
        new = _loader(n, batch, 4, rank, sampler_drop_last=True)
        data.plan_resume(new.batch_sampler.sampler, new, pos, exact=False, epoch=0)
        streams.append([i for b in new for i in b.tolist()])
    assert [len(s) for s in streams] == [10] * 4  # 42 left: 40 used, the last 2 dropped
    assert sorted(i for s in streams for i in s) == sorted(order[48:88])


def test_a_resumed_epoch_saved_again_continues_the_same_order():
    """2 ranks -> 3 ranks (snapshot again after 2 more batches) -> 1 rank: still the one global order."""
    n, batch = 90, 4
    order = torch.randperm(n, generator=torch.Generator().manual_seed(42)).tolist()
    first = _loader(n, batch, 2, 0)
    _consume(first, 6)
    pos = data.position(first, 0, 6)  # 48 samples
    positions = []
    for rank in range(3):
        loader = _loader(n, batch, 3, rank)
        start = data.plan_resume(loader.batch_sampler.sampler, loader, pos, exact=False, epoch=0)
        assert start == len(loader) - 4  # 42 left over 3 ranks: 14 each, 4 batches
        _consume(loader, 2)
        positions.append(data.position(loader, 0, start + 2))
    assert positions[0]["global"]["samples"] == 48 + 2 * batch * 3 == 72
    single = _loader(n, batch, None)
    data.plan_resume(single.batch_sampler.sampler, single, positions[0], exact=False, epoch=0)
    assert [i for b in single for i in b.tolist()] == order[72:]


def test_one_process_random_sampler_resumed_on_two_ranks_replays_its_permutation():
    n, batch = 40, 4
    torch.manual_seed(3)
    loader = _loader(n, batch, None)
    it = iter(loader)
    seen = [next(it).tolist() for _ in range(3)]
    # what the uninterrupted process trains on
    full = [i for b in seen for i in b] + [i for b in it for i in b.tolist()]
    # (rebuild the position as of 3 batches: the iterator ran to the end above, the sampler state is per epoch)
    pos = data.position(loader, 0, 3)
    assert pos["global"]["samples"] == 12 and pos["global"]["order"]["kind"] == "random"
    torch.manual_seed(1234)  # another RNG state in the resumed run: the permutation is the saved one anyway
    streams = []
    for rank in range(2):
        new = _loader(n, batch, 2, rank)
        data.plan_resume(new.batch_sampler.sampler, new, pos, exact=False, epoch=0)
        streams.append([i for b in new for i in b.tolist()])
    assert streams[0] == full[12::2] and streams[1] == full[13::2]


def test_same_layout_keeps_the_exact_replay():
    n, batch = 96, 4
    loader = _loader(n, batch, 2, 1)
    seen = [i for b in loader for i in b.tolist()]
    again = _loader(n, batch, 2, 1)
    pos = data.position(loader, 0, 5)
    assert data.plan_resume(again.batch_sampler.sampler, again, pos, exact=True, epoch=0) is None
    assert [i for b in again for i in b.tolist()] == seen[20:]


def test_sequential_and_unknown_samplers():
    ds = list(range(10))
    assert data.describe_order(SequentialSampler(ds), torch.get_rng_state(), None) == {"kind": "sequential", "n": 10}
    assert data.global_order({"kind": "sequential", "n": 10}) == ds
    with_replacement = RandomSampler(ds, replacement=True)
    assert data.describe_order(with_replacement, torch.get_rng_state(), None) is None
    loader = DataLoader(ds, batch_size=2, sampler=with_replacement)
    data.install(loader)
    _consume(loader, 1)
    pos = data.position(loader, 0, 1)
    assert pos["global"] is None
    new = DataLoader(ds, batch_size=2, sampler=DistributedSampler(ds, num_replicas=2, rank=0))
    data.install(new)
    with pytest.warns(UserWarning, match="cannot be replayed on another number of processes"):
        assert data.plan_resume(new.batch_sampler.sampler, new, pos, exact=False, epoch=0) is None


def test_random_generators_a_dataset_holds_are_named_for_the_warning():
    """A dataset that draws from a generator of its own (numpy's default_rng, a torch.Generator, random.Random) is
    not resumed exactly: the callback warns, naming them, also through Subset and ConcatDataset."""
    import random

    import numpy as np
    from torch.utils.data import ConcatDataset, Dataset, Subset

    class Noisy(Dataset):
        def __init__(self) -> None:
            self.rng = np.random.default_rng(0)
            self.gen = torch.Generator()
            self.py = random.Random(1)

        def __len__(self) -> int:
            return 4

        def __getitem__(self, i: int) -> float:
            return float(self.rng.normal())

    class Kept(Noisy):  # keeps its own state: Lightning restores it through torchdata's StatefulDataLoader
        def state_dict(self) -> dict:
            return {}

    assert data.dataset_generators(Noisy()) == ["rng", "gen", "py"]
    assert data.dataset_generators(Subset(Noisy(), [0, 1])) == ["dataset.rng", "dataset.gen", "dataset.py"]
    assert data.dataset_generators(ConcatDataset([Kept(), Noisy()]))[:1] == ["datasets[1].rng"]
    assert data.dataset_generators(Kept()) == [] and data.dataset_generators(None) == []
