"""The rest of a restore, after ``on_fit_start`` read and loaded the snapshot: the state parts of the later phases,
applied at the callback's hooks, and what a resume within Lightning's loops needs besides (the loops set to resume,
the epoch's start schedulers reinstated).

The Restorer (restore.py) returns a :class:`Restored` holding a :class:`Resumption`; the callback calls
:meth:`Resumption.fit_start` at the end of its ``on_fit_start``, :meth:`Resumption.train_start` at
``on_train_start`` and :meth:`Resumption.first_fetch` right before each fetch (it acts once). The parts are
:mod:`lightning_snapshot.state.builtin`; their phases :class:`~lightning_snapshot.state.parts.Phase`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from lightning_snapshot.state import compat as _compat
from lightning_snapshot.state import patches as _patches
from lightning_snapshot.state.builtin import REGISTRY
from lightning_snapshot.state.parts import Phase, RestoreContext

__all__ = ["LATER", "Restored", "Resumption", "report_restore"]

#: the phases after the restore of ``on_fit_start``, in order
LATER = (Phase.FIT_START, Phase.TRAIN_START, Phase.EPOCH, Phase.FIRST_FETCH)


class Resumption:
    """The state parts of the later phases of one restore (only their states are kept), and when to apply them."""

    def __init__(self, ctx: RestoreContext, shared: Any, section: Any) -> None:
        self.ctx = ctx
        self._shared, self._section = REGISTRY.extract(LATER, shared, section)
        self._fetched = False

    def _apply(self, phase: Phase) -> None:
        REGISTRY.restore(phase, self.ctx, self._shared, self._section)

    def fit_start(self, loaders: Any, patches: Any, hooked: Callable[[], bool]) -> None:
        """At the end of ``on_fit_start``, before Lightning makes the train loaders: the loader positions (given to
        ``loaders``, which puts them back as the loaders are made), the epoch the loaders were made at."""
        self.ctx.loaders, self.ctx.patches, self.ctx.hooked = loaders, patches, hooked
        self._apply(Phase.FIT_START)

    def train_start(self) -> None:
        """At ``on_train_start`` (after every other callback's ``on_fit_start``): a stop request and the model's own
        generators; the loops set to resume from the snapshot's point; then what the epoch's start hooks set up
        (within an epoch they do not run again: SWA's SWALR, the gradient accumulation of
        GradientAccumulationScheduler, the epoch's accumulated training metrics); at an epoch boundary also the RNG,
        before the next epoch's iterators draw from it."""
        ctx = self.ctx
        trainer, pl_module = ctx.trainer, ctx.pl_module
        self._apply(Phase.TRAIN_START)
        boundary = ctx.resumed == "boundary"
        rerun = self.first_fetch if ctx.validation_pending and not boundary else None
        _patches.resume_loops(ctx.patches, trainer, boundary=boundary, validate_first=rerun)
        if not boundary:
            _compat.reinstate_epoch_start_schedulers(trainer, pl_module)
        _compat.reinstate_swalr_after_averaging(trainer, pl_module)
        self._apply(Phase.EPOCH)
        if boundary:  # (the next epoch starts as in a run that never stopped)
            self.first_fetch()

    def first_fetch(self) -> None:
        """Right before the first batch is fetched (once): the state parts taken at that point (the RNG)."""
        if not self._fetched:
            self._fetched = True
            self._apply(Phase.FIRST_FETCH)


@dataclass(frozen=True)
class Restored:
    """What a restore did, and what the rest of the fit must still put back (:attr:`resumption`)."""

    url: str
    step: int
    seconds: float
    #: index of the tier in the callback's tiers, or None (a snapshot path given as ``resume``)
    tier_index: int | None
    #: "boundary": the snapshot ended an epoch (the next starts from its beginning); "mid": it continues an epoch
    resumed: str
    #: the state parts still to apply, at the later phases
    resumption: Resumption


def report_restore(metrics: Any, restored: Restored, stats: dict[str, int | None] | None) -> None:
    """The ``restore/...`` metrics of a restore."""
    metrics.add("restore/ms", restored.seconds * 1000)
    metrics.add("restore/step", restored.step)
    if stats is not None:
        metrics.add("restore/bytes_read", stats["bytes_read"] or 0)
        metrics.add("restore/bytes_received", stats["bytes_received"] or 0)
        metrics.add("restore/job_bytes_read", stats["job_bytes_read"] or 0)
    if restored.tier_index is not None:
        metrics.add("restore/tier_index", restored.tier_index)
