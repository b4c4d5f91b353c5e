"""A loader's iterators and the RNG of its workers: start a resumed iterator as the interrupted one started.

One job: :class:`IteratorTracker`, installed as a loader's ``_get_iterator``, follows each iterator (the RNG it was
created from, how many batches it gave) and, with ``num_workers > 0``, the torch/python/numpy RNG states each worker
sent with each batch (:class:`_Collate` wraps the batch in the worker, the tracker unwraps it in the main process);
a resumed iterator is created from the recorded RNG, its round robin rotated, and its workers' RNG set by
:class:`_WorkerInit`. :class:`_Collate`, :class:`_WorkerInit` and :class:`_Batch` are pickled to spawned workers:
their import path is this module. Called by :mod:`~lightning_snapshot.data.loaders` (install, position,
plan_resume); see :mod:`lightning_snapshot.data` for the whole design.
"""

from __future__ import annotations

import itertools
import logging
import random
import warnings
import weakref
from collections import deque
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, get_worker_info

from lightning_snapshot.data.samplers import resumable_of

__all__ = ["IteratorTracker", "tracker_of"]

log = logging.getLogger(__name__)


def _rng_now() -> tuple[bytes, Any, Any]:
    """This process's torch CPU, python and numpy global RNG states, compact (sent with every worker batch)."""
    return torch.get_rng_state().numpy().tobytes(), random.getstate(), np.random.get_state()


def _rng_dict(compact: tuple[bytes, Any, Any]) -> dict[str, Any]:
    """:func:`_rng_now` output in the form of :func:`lightning_snapshot.data.rng.capture_rng`."""
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
        from torch.utils.data._utils.pin_memory import pin_memory  # noqa: PLC2701

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
            from lightning_snapshot.data.rng import restore_rng

            restore_rng(state)


def _reseed_worker(worker_id: int, base_seed: int) -> None:
    """Seed this worker as torch seeds a worker of base seed ``base_seed`` (torch's ``_worker_loop``), including
    what ``get_worker_info().seed`` and ``torch.initial_seed()`` say; nothing when it already is."""
    from torch.utils.data._utils import worker as _worker  # noqa: PLC2701

    info = get_worker_info()
    seed = base_seed + worker_id
    if info is None or info.seed == seed:
        return
    random.seed(seed)
    torch.manual_seed(seed)
    np.random.seed(_worker._generate_state(base_seed, worker_id))
    _worker._worker_info = _worker.WorkerInfo(id=info.id, num_workers=info.num_workers, seed=seed, dataset=info.dataset)


class IteratorTracker:
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
        return IteratorTracker, (self._loader(),)

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
        draws = resumable_of(loader).draws
        it = self._create(loader, wplan, hold)
        if hold:
            if replay is None:
                _set_rng_of(gen, live)  # (undo the base seed draw: the workers are reseeded to the saved one)
            elif not replay.get("created", True):
                _set_rng_of(gen, replay)  # persistent workers were only reset then: no base seed was drawn
            if resumable_of(loader).pending is not None:
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
        sampler = resumable_of(loader)
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
        sampler = resumable_of(loader)
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


def tracker_of(loader: Any) -> IteratorTracker | None:
    """The tracker :func:`install` put on ``loader``, or None."""
    hook = getattr(loader, "__dict__", {}).get("_get_iterator")
    owner = getattr(hook, "__self__", None)
    return owner if isinstance(owner, IteratorTracker) else None
