"""Random augmentation is resumed bit for bit (lightning_snapshot.data), with plain DataLoaders and no Lightning.

An uninterrupted run iterates 3 epochs and records, right before each batch is fetched, the position and the
process-global RNG (what the callback captures there). A resumed run starts in a fresh loader from another global RNG
state, installs, plans the resume from the recorded position, creates its iterator, sets the global RNG to the
uninterrupted run's state at the cut (the callback restores it right before the next fetch) and continues: every
batch from the cut on must be bitwise the uninterrupted one, whether the dataset augments in the main process or in
workers (persistent or not, with Lightning's worker_init_fn reseeding numpy, python and torch).
"""

from __future__ import annotations

import functools
import itertools
import json
import random

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from lightning_snapshot import data
from lightning_snapshot.data import workers as data_workers
from lightning_snapshot.format import tree as _tree
from lightning_snapshot.staging import stage

N, BATCH, EPOCHS = 11, 2, 3  # 6 batches an epoch, the last one of a single sample


class Augmented(Dataset):
    """Each sample: its index and one draw each from torch, python random and numpy (random augmentation)."""

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor(
            [float(i), torch.rand((), dtype=torch.float64).item(), random.random(), float(np.random.rand())],
            dtype=torch.float64,
        )


def _pl_init():
    """Lightning's worker_init_fn, as ``seed_everything(workers=True)`` makes Lightning add it (reseeds torch, python
    and numpy from the worker's base seed). Imported here: spawned workers import this module without Lightning."""
    from lightning.fabric.utilities.seed import pl_worker_init_function

    return functools.partial(pl_worker_init_function, rank=0)


def _init_with_extra_draw(worker_id: int) -> None:
    """A user worker_init_fn that moves every RNG (on top of Lightning's reseeding)."""
    from lightning.fabric.utilities.seed import pl_worker_init_function

    pl_worker_init_function(worker_id, rank=0)
    torch.rand(worker_id + 1)
    random.random()
    np.random.rand(worker_id + 1)


def _reseed_numpy(worker_id: int) -> None:
    """The classic user fix for numpy's identical streams in forked workers."""
    np.random.seed(torch.initial_seed() % 2**32)


def _make(
    workers: int = 0, persistent: bool = False, init="pl", generator: int | None = None, context: str | None = None
):
    init = _pl_init() if init == "pl" else init

    def make() -> DataLoader:
        return DataLoader(
            Augmented(),
            batch_size=BATCH,
            shuffle=True,
            num_workers=workers,
            persistent_workers=persistent,
            worker_init_fn=init if workers else None,
            generator=torch.Generator().manual_seed(generator) if generator is not None else None,
            multiprocessing_context=context if workers else None,
        )

    return make


def _seed(seed: int) -> None:
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed)


def _rng() -> tuple:
    return torch.get_rng_state(), random.getstate(), np.random.get_state()


def _set_rng(state: tuple) -> None:
    torch.set_rng_state(state[0])
    random.setstate(state[1])
    np.random.set_state(state[2])


def _train_step() -> None:
    """What the main process draws between two fetches (dropout, noise...)."""
    torch.rand(3)
    random.random()
    np.random.rand(2)


def _stored(pos):
    """The position as the callback stores and reads it back: staged with the rank state, its tree through JSON."""
    staged = stage({"loaders": [pos]}, "rank")
    return _tree.decode(json.loads(json.dumps(staged.tree)), staged.tensors)["loaders"][0]


def _uninterrupted(make, epochs: int = EPOCHS, limit: int | None = None):
    """``limit``: batches taken of each epoch (Lightning's limit_train_batches: the rest is never fetched)."""
    _seed(0)
    loader = make()
    assert data.install(loader) is not None
    batches, cuts = {}, {}
    for epoch in range(epochs):
        it = iter(loader)
        for i in itertools.count():
            cuts[(epoch, i)] = (_rng(), _stored(data.position(loader, epoch, i)))
            try:
                if i == limit:
                    raise StopIteration
                batch = next(it)
            except StopIteration:
                del cuts[(epoch, i)]
                break
            batches[(epoch, i)] = batch
            _train_step()
    return batches, cuts


def _resumed(make, cut, state, epochs: int = EPOCHS, limit: int | None = None):
    epoch, n = cut
    rng, pos = state
    _seed(12345)  # the resumed process starts from another RNG state
    loader = make()
    sampler = data.install(loader)
    assert data.plan_resume(sampler, loader, pos, exact=True, epoch=epoch) is None
    batches = {}
    for e in range(epoch, epochs):
        it = iter(loader)
        if e == epoch:
            _set_rng(rng)  # the callback restores the RNG right before the next fetch
        for i in itertools.count(n if e == epoch else 0):
            try:
                if i == limit:
                    raise StopIteration
                batch = next(it)
            except StopIteration:
                break
            batches[(e, i)] = batch
            _train_step()
    return batches


def _assert_continues(full, cut, got):
    expected = {k: v for k, v in full.items() if k >= cut}
    assert sorted(got) == sorted(expected), f"resumed at {cut}: other batches"
    for k, v in expected.items():
        assert torch.equal(got[k], v), f"resumed at {cut}: batch {k} differs\n{got[k]}\n{v}"


def _differs(full, cut, got) -> bool:
    return any(not torch.equal(got[k], v) for k, v in full.items() if k >= cut and k in got)


# ------------------------------------------------------------------------------------------------ no workers


@pytest.mark.parametrize("generator", [None, 7])
def test_main_process_augmentation_resumes_bitwise_at_every_batch(generator):
    make = _make(workers=0, generator=generator)
    full, cuts = _uninterrupted(make)
    assert len(full) == EPOCHS * 6
    for cut in sorted(cuts):  # every batch of every epoch: first, mid, last
        _assert_continues(full, cut, _resumed(make, cut, cuts[cut]))


def test_epoch_start_without_workers_has_no_order_yet():
    make = _make(workers=0)
    _, cuts = _uninterrupted(make)
    pos = cuts[(1, 0)][1]
    assert pos["drawn"] is False and pos["rng"] is None and pos["global"] is None and pos["iter_rng"] is not None
    mid = cuts[(1, 2)][1]
    assert mid["drawn"] is True and mid["skip"] == 2 * BATCH and mid["workers"] is None


def test_sampler_replay_leaves_the_global_rng_alone():
    """(c): replaying the recorded order must not clobber the global RNG the callback restored before the fetch."""
    make = _make(workers=0)
    _, cuts = _uninterrupted(make)
    rng, pos = cuts[(0, 3)]
    loader = make()
    sampler = data.install(loader)
    data.plan_resume(sampler, loader, pos, exact=True, epoch=0)
    it = iter(loader)
    torch.manual_seed(99)
    before = torch.get_rng_state()
    gen = iter(loader.batch_sampler)
    next(gen)  # the replayed draw
    assert torch.equal(torch.get_rng_state(), before)
    del it


# ------------------------------------------------------------------------------------------------ workers

WORKER_CUTS = [(0, 0), (0, 1), (0, 3), (1, 0), (1, 5), (2, 2)]  # first, odd (round robin rotated), last batch


@pytest.mark.parametrize("persistent", [False, True], ids=["fresh-workers", "persistent-workers"])
def test_worker_augmentation_resumes_bitwise(persistent):
    make = _make(workers=2, persistent=persistent)
    full, cuts = _uninterrupted(make)
    for cut in WORKER_CUTS:
        _assert_continues(full, cut, _resumed(make, cut, cuts[cut]))
    pos = cuts[(1, 3)][1]
    assert pos["workers"]["num_workers"] == 2 and pos["workers"]["persistent"] is persistent
    assert all(s is not None for s in pos["workers"]["states"])


@pytest.mark.filterwarnings("ignore:This DataLoader will create 3 worker processes")
def test_three_persistent_workers_with_a_user_init_fn_and_generator():
    make = _make(workers=3, persistent=True, init=_init_with_extra_draw, generator=5)
    full, cuts = _uninterrupted(make)
    for cut in [(0, 1), (0, 2), (1, 4), (2, 0)]:
        _assert_continues(full, cut, _resumed(make, cut, cuts[cut]))


@pytest.mark.parametrize("persistent", [False, True], ids=["fresh-workers", "persistent-workers"])
def test_truncated_epochs(persistent):
    """Epochs cut short (limit_train_batches): batches fetched ahead but never used still moved the workers' RNG
    (persistent workers carry it into the next epoch)."""
    make = _make(workers=2, persistent=persistent, init=_reseed_numpy)
    full, cuts = _uninterrupted(make, limit=3)
    assert len(full) == EPOCHS * 3
    for cut in [(0, 1), (1, 0), (1, 2), (2, 1)]:
        _assert_continues(full, cut, _resumed(make, cut, cuts[cut], limit=3))


def test_without_the_worker_restore_the_batches_differ():
    """Negative control: the same resume from a position without what this module adds (a snapshot of an older
    version: no iterator RNG, no worker RNG) does not give the uninterrupted batches."""
    for persistent in (False, True):
        make = _make(workers=2, persistent=persistent)
        full, cuts = _uninterrupted(make)
        for cut in [(0, 3), (1, 2)]:
            rng, pos = cuts[cut]
            old = {k: v for k, v in pos.items() if k not in ("iter_rng", "workers", "drawn")}
            got = _resumed(make, cut, (rng, old))
            assert sorted(got) == sorted(k for k in full if k >= cut)
            assert _differs(full, cut, got), (persistent, cut)


def test_batches_are_the_users_and_loader_attributes_untouched():
    make = _make(workers=2)
    loader = make()
    collate, init = loader.collate_fn, loader.worker_init_fn
    data.install(loader)
    batches = list(loader)
    assert all(type(b) is torch.Tensor and b.shape[1] == 4 for b in batches)
    assert loader.collate_fn is collate and loader.worker_init_fn is init
    data.install(loader)  # idempotent
    assert len(list(loader)) == 6


def test_prefetched_batches_do_not_count():
    """The main process may hold batches past the cut (fetched ahead): only the workers' states of the batches
    before it go into the position."""
    make = _make(workers=2)
    _seed(0)
    loader = make()
    data.install(loader)
    it = iter(loader)
    batches = [next(it) for _ in range(5)]
    at3 = data.position(loader, 0, 3)  # batches 3 and 4 already fetched
    _seed(0)
    ref = make()
    data.install(ref)
    it2 = iter(ref)
    for _ in range(3):
        next(it2)
    exact = data.position(ref, 0, 3)
    for a, b in zip(at3["workers"]["states"], exact["workers"]["states"]):
        assert torch.equal(a["torch"], b["torch"]) and a["python"][0] == b["python"][0]
        assert np.array_equal(a["python"][1], b["python"][1]) and a["python"][2] == b["python"][2]
        assert np.array_equal(a["numpy"][1], b["numpy"][1]) and a["numpy"][2:] == b["numpy"][2:]
    assert len(batches) == 5
    del it, it2


def test_pin_memory_thread_keeps_the_wrapper(monkeypatch):
    """torch's pin-memory thread pins whatever has a pin_memory(): the batch inside the wrapper is pinned."""
    from torch.utils.data._utils.pin_memory import pin_memory

    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self, *a, **k: self + 1)
    wrapped = data_workers._Batch({"x": torch.zeros(2)}, 1, ("rng",))
    out = pin_memory(wrapped, "cuda")
    assert type(out) is data_workers._Batch and out.worker == 1 and out.rng == ("rng",)
    assert torch.equal(out.data["x"], torch.ones(2))


@pytest.mark.slow
def test_spawned_persistent_workers_resume_bitwise():
    """With the spawn start method the wrappers (and the resumed RNG states) are pickled to the workers."""
    make = _make(workers=2, persistent=True, init=_reseed_numpy, context="spawn")
    full, cuts = _uninterrupted(make, epochs=2)
    cut = (1, 3)
    _assert_continues(full, cut, _resumed(make, cut, cuts[cut], epochs=2))


def test_position_survives_a_real_snapshot(tmp_path):
    """Written to a local tier and loaded back, the position resumes the same batches."""
    from lightning_snapshot.backends.local import LocalTier
    from lightning_snapshot.dist.comm import LocalComm
    from lightning_snapshot.persist.writer import SnapshotJob, write_snapshot
    from lightning_snapshot.restore.loader import load_snapshot

    make = _make(workers=2, persistent=True)
    full, cuts = _uninterrupted(make, epochs=2)
    cut = (1, 3)
    rng, _ = cuts[cut]
    _seed(0)
    loader = make()
    data.install(loader)
    for e in range(2):
        it = iter(loader)
        for i in range(6 if e == 0 else cut[1]):
            next(it)
            _train_step()
    raw = data.position(loader, *cut)
    job = SnapshotJob(1, 1, shared=stage({"x": torch.zeros(1)}), private=stage({"loaders": [raw]}, "rank"))
    write_snapshot(LocalTier(tmp_path), LocalComm(), job, run_id="abc")
    pos = load_snapshot(str(tmp_path), rank=0)["rank_state"]["loaders"][0]
    del it
    _assert_continues({k: v for k, v in full.items() if k[0] < 2}, cut, _resumed(make, cut, (rng, pos), epochs=2))


@pytest.mark.parametrize("workers", [0, 2])
def test_position_before_the_epochs_iterator_exists_replays_nothing(workers):
    """Taken at an epoch boundary before the next epoch's iterator was created: nothing recorded belongs to that
    epoch (the previous iterator's order, base seed and worker states must not be replayed)."""
    make = _make(workers=workers)
    _seed(0)
    loader = make()
    sampler = data.install(loader)
    assert data.position(loader, 0, 0) is None  # no iterator, no order yet
    it = iter(loader)
    assert len(list(it)) == 6
    pos = _stored(data.position(loader, 1, 0))
    assert pos["drawn"] is False and pos["rng"] is None and pos["iter_rng"] is None and pos["workers"] is None
    fresh = make()
    assert data.plan_resume(data.install(fresh), fresh, pos, exact=True, epoch=1) is None
    assert fresh.batch_sampler.sampler.pending is None and data_workers.tracker_of(fresh).plan["iter_rng"] is None
    del it, sampler


def test_unpicklable_user_functions_still_work_with_fork():
    """The wrappers only hold the user's functions: what worked before (lambdas under fork) still works."""
    loader = DataLoader(
        Augmented(),
        batch_size=BATCH,
        shuffle=True,
        num_workers=2,
        collate_fn=lambda samples: torch.stack(samples) * 1,
        worker_init_fn=lambda w: None,
        multiprocessing_context="fork",
    )
    data.install(loader)
    assert [b.shape[0] for b in loader] == [2, 2, 2, 2, 2, 1]
    assert data.position(loader, 0, 6)["workers"]["num_workers"] == 2


def test_distributed_sampler_resumed_with_workers_before_set_epoch():
    """Under DDP Lightning creates a resumed run's iterator (whose workers draw the order at once) before it calls
    ``set_epoch``: the replay must draw the interrupted epoch's order, not epoch 0's."""
    from torch.utils.data import DistributedSampler

    def make() -> DataLoader:
        ds = Augmented()
        return DataLoader(
            ds,
            batch_size=BATCH,
            sampler=DistributedSampler(ds, num_replicas=2, rank=1, seed=3),
            num_workers=2,
            persistent_workers=True,
            worker_init_fn=_pl_init(),
        )

    _seed(0)
    loader = make()
    data.install(loader)
    full, cut_state = {}, None
    for epoch in range(2):
        loader.batch_sampler.sampler.set_epoch(epoch)  # (Lightning's order in an uninterrupted run)
        it = iter(loader)
        for i, batch in enumerate(it):
            full[(epoch, i)] = batch
            if (epoch, i + 1) == (1, 1):
                cut_state = (_rng(), _stored(data.position(loader, 1, 1)))
            _train_step()
    rng, pos = cut_state
    assert pos["sampler_epoch"] == 1
    _seed(12345)
    resumed = make()
    data.plan_resume(data.install(resumed), resumed, pos, exact=True, epoch=1)
    it = iter(resumed)  # before set_epoch, as Lightning's FitLoop.setup_data does
    resumed.batch_sampler.sampler.set_epoch(1)
    _set_rng(rng)
    got = {(1, i): b for i, b in enumerate(it, start=1)}
    _assert_continues(full, (1, 1), got)


@pytest.mark.parametrize("iterated_again", [True, False], ids=["lightning-restarts-the-epoch", "first-batch"])
def test_persistent_workers_carry_their_rng_over_a_snapshot_at_an_epoch_end(iterated_again):
    """A snapshot at the end of training after a whole epoch (the next epoch's iterator does not exist yet) holds the
    persistent workers' RNG; a continued run whose iterator is created before the RNG is restored (Lightning's
    FitLoop.setup_data), and started again for the epoch or not, continues as the uninterrupted workers did."""
    make = _make(workers=2, persistent=True)
    _seed(0)
    loader = make()
    data.install(loader)
    full, cut = {}, None
    for epoch in range(3):
        if epoch == 1:
            cut = (_rng(), _stored(data.position(loader, 1, 0, ended=True)))
        for i, batch in enumerate(iter(loader)):
            full[(epoch, i)] = batch
            _train_step()
    rng, pos = cut
    assert pos["drawn"] is False and pos["iter_rng"] is None
    assert pos["workers"]["persistent"] is True and all(s is not None for s in pos["workers"]["states"])
    _seed(12345)
    resumed = make()
    data.plan_resume(data.install(resumed), resumed, pos, exact=True, epoch=1)
    it = iter(resumed)  # created before the RNG is restored
    _set_rng(rng)
    if iterated_again:
        it = iter(resumed)
    got = {}
    for epoch in (1, 2):
        if epoch == 2:
            it = iter(resumed)
        for i, batch in enumerate(it):
            got[(epoch, i)] = batch
            _train_step()
    _assert_continues(full, (1, 0), got)
