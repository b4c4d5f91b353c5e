"""Data position for plain ``DataLoader``s: record it, and fast-forward the sampler on resume.

This package re-exports what the callback and users import from ``lightning_snapshot.data`` (the tests import the
parts from the module that defines them); the parts, one job each:

* :mod:`~lightning_snapshot.data.order`: the order arithmetic (pure: no I/O, no process group);
* :mod:`~lightning_snapshot.data.samplers`: :class:`ResumableSampler` and :class:`DrawRecorder`;
* :mod:`~lightning_snapshot.data.workers`: the iterator tracker and the loader workers' RNG;
* :mod:`~lightning_snapshot.data.loaders`: install, capture (:func:`position`) and resume (:func:`plan_resume`);
* :mod:`~lightning_snapshot.data.rng`: a process's RNG states (the snapshot's per-rank RNG, a resumed worker's).

May import: nothing else of the package (it sits below the state parts that capture it).

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

What random augmentation draws is restored too (:class:`IteratorTracker`, installed with the sampler):

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

from lightning_snapshot.data.loaders import dataset_generators as dataset_generators
from lightning_snapshot.data.loaders import (
    flatten_loaders,
    install,
    is_stateful,
    plan_resume,
    position,
    unsupported_reason,
)
from lightning_snapshot.data.loaders import own_batches as own_batches
from lightning_snapshot.data.order import describe_order, global_order, split
from lightning_snapshot.data.samplers import DrawRecorder, ResumableSampler

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
