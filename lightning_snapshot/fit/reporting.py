"""What the user is told about the snapshots: results to metrics and warnings, the ``on_error`` policy, and the check
that a durable tier holds the fit's last snapshot.

One :class:`Reporter` per callback, on the training thread: the snapshot pipeline tells it what happened (a snapshot
skipped, a tier's queue full, a capture error), it reads the persist threads' results (:meth:`Reporter.collect`),
and the callback flushes its metrics to the trainer's loggers. Metric names: :mod:`lightning_snapshot.fit.metrics`.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Sequence
from typing import Any

from lightning_snapshot.backends.base import Backend
from lightning_snapshot.dist.agree import agree_on
from lightning_snapshot.dist.comm import Comm
from lightning_snapshot.errors import NotDurableError, TornSnapshotError
from lightning_snapshot.fit.metrics import MetricsSink, tier_metric_names
from lightning_snapshot.schedule.schedules import FitSchedule

__all__ = ["Reporter"]

log = logging.getLogger(__name__)


class Reporter:
    """Results, failures and metrics of one callback's snapshots (training thread only).

    Args:
        tiers: the callback's tiers.
        on_error: ``"raise"`` or ``"warn"`` (see :class:`~lightning_snapshot.callback.SnapshotCallback`).
    """

    def __init__(self, tiers: Sequence[Backend], on_error: str) -> None:
        self.tiers = list(tiers)
        self.on_error = on_error
        self.metrics = MetricsSink()
        self.names = tier_metric_names(self.tiers)
        #: per tier index: the newest step committed there in this fit
        self.committed: dict[int, int] = {}
        #: per tier index: the last step handed to its persist worker in this fit
        self.submitted: dict[int, int] = {}
        #: per tier index: why its last snapshot is not there (the durability check says it)
        self.problems: dict[int, str] = {}
        #: the newest step snapshotted for a durable tier in this fit
        self.last_durable_due: int | None = None
        self.fit_start_step = 0
        self._skipped = 0
        self._tier_skipped = [0] * len(self.tiers)
        self._torn_steps: set[int] = set()
        self._failed = 0
        self._errors: list[BaseException] = []

    def start(self, step: int) -> None:
        """A fit starts at ``step``."""
        self.committed, self.submitted, self.problems = {}, {}, {}
        self.last_durable_due = None
        self.fit_start_step = step

    # ------------------------------------------------------------------------------------------- events
    def skipped(
        self, step: int, reason: str, last: bool, advice: str = "Raise max_host_bytes or snapshot less often."
    ) -> None:
        """No snapshot of ``step``: the arena had no room, another rank could not stage it, or its replicas disagree
        (``last``: fit's last)."""
        if last:
            warnings.warn(f"lightning-snapshot: no snapshot of the last step {step}: {reason}", stacklevel=3)
            return
        self._skipped += 1
        self.metrics.add("snapshot/skipped", self._skipped)
        warnings.warn(f"lightning-snapshot: skipped the snapshot of step {step}: {reason}. {advice}", stacklevel=3)

    def queue_full(self, index: int, step: int, pending: int) -> None:
        """Tier ``index`` skips the snapshot of ``step``: ``pending`` snapshots are still queued there."""
        self._tier_skipped[index] += 1
        self.metrics.add(f"snapshot/{self.names[index]}/skipped", self._tier_skipped[index])
        self.problems.setdefault(
            index, f"step {step} was skipped there: {pending} snapshot(s) still pending (max_pending)"
        )
        tier = self.tiers[index]
        log.info(
            "lightning-snapshot: step %d skipped for the %s tier %s: %d snapshot(s) still pending there",
            step,
            tier.tier,
            tier.url,
            pending,
        )

    def handed_over(self, step: int, indices: Sequence[int]) -> None:
        """The snapshot of ``step`` went to these tiers' persist workers."""
        for i in indices:
            self.submitted[i] = step

    def handle(self, error: BaseException, step: int, tier: Backend | None = None) -> None:
        """A snapshot could not be taken: raise ``error`` (``on_error="raise"``) or warn."""
        where = f" to the {tier.tier} tier {tier.url!r}" if tier is not None else ""
        if self.on_error == "raise":
            raise error
        warnings.warn(
            f"lightning-snapshot: the snapshot of step {step}{where} failed and training goes on"
            f" (on_error='warn'): {error}",
            stacklevel=3,
        )

    def stop_if_failed(self, comm: Comm) -> None:
        """Collective: with ``on_error="raise"``, a snapshot that failed in the background on any rank stops every
        rank together, here."""
        failed = self._errors[0] if self._errors and self.on_error == "raise" else None
        agreed = agree_on(
            comm,
            "whether a snapshot failed to persist",
            error=failed,
            elsewhere="a snapshot failed to persist on another rank (see its log); stopping (on_error='raise')",
        )
        if not agreed.ok:
            self._errors = []
            agreed.result()

    # ------------------------------------------------------------------------------------------- results
    def collect(self, persister: Any, step: int, schedule: FitSchedule | None) -> None:
        """Turn what the persist threads finished into metrics, and failures into warnings."""
        if persister is None:
            return
        while not persister.results.empty():
            r = persister.results.get_nowait()
            name = self.names[self.tiers.index(r.tier)] if r.tier in self.tiers else r.tier.tier
            index = self.tiers.index(r.tier) if r.tier in self.tiers else None
            if r.error is not None and index is not None and not isinstance(r.error, TornSnapshotError):
                self.problems[index] = f"step {r.step} failed: {r.error}"
            if index is not None and schedule is not None:
                schedule.closed(index, measured=not r.abandoned and not isinstance(r.error, TornSnapshotError))
            if isinstance(r.error, TornSnapshotError):  # (every tier of that step reports it: one warning)
                if r.step not in self._torn_steps:
                    self._torn_steps.add(r.step)
                    self._skipped += 1
                    self.metrics.add("snapshot/skipped", self._skipped)
                    warnings.warn(f"lightning-snapshot: skipped the snapshot of {r.error}", stacklevel=3)
                continue
            if r.abandoned:
                warnings.warn(
                    f"lightning-snapshot: gave up uploading step {r.step} to the {r.tier.tier} tier"
                    f" {r.tier.url!r} at the end of training (drain_timeout): {r.error}",
                    stacklevel=3,
                )
                continue
            if r.error is not None:
                self._failed += 1
                self._errors.append(r.error)
                self.metrics.add("snapshot/failed", self._failed)
                policy = "training goes on (on_error='warn')" if self.on_error == "warn" else "training will stop"
                warnings.warn(
                    f"lightning-snapshot: the snapshot of step {r.step} to the {r.tier.tier} tier"
                    f" {r.tier.url!r} failed; {policy}: {r.error}",
                    stacklevel=3,
                )
                continue
            self.committed[self.tiers.index(r.tier)] = r.step
            self.problems.pop(self.tiers.index(r.tier), None)
            self.metrics.add(f"snapshot/{name}/persist_ms", r.seconds * 1000)
            self.metrics.add(f"snapshot/{name}/throughput_MBps", r.nbytes / 1e6 / max(r.seconds, 1e-9))
            if r.stage_seconds is not None:
                self.metrics.add("snapshot/stage_ms", r.stage_seconds * 1000)
        for i in self.submitted:  # (a tier that never committed in this fit lags from where the fit started)
            self.metrics.add(f"snapshot/{self.names[i]}/lag_steps", step - self.committed.get(i, self.fit_start_step))
            if self.tiers[i].retry_initial:
                self.metrics.add(f"snapshot/{self.names[i]}/retries", persister.retries(i))

    def late_tiers(self, late: Sequence[Backend], persister: Any) -> None:
        """These tiers did not finish their uploads within their ``drain_timeout`` at the end of fit."""
        for tier in late:
            i = self.tiers.index(tier)
            error = persister.last_error(i) if persister is not None else None
            self.problems.setdefault(
                i,
                f"its uploads did not finish within drain_timeout={tier.drain_timeout} s"
                f" (last error: {error or 'none'})",
            )
            warnings.warn(
                f"lightning-snapshot: the {tier.tier} tier {tier.url!r} did not finish its uploads within"
                f" drain_timeout={tier.drain_timeout} s; {self.holders()}",
                stacklevel=3,
            )

    def holders(self) -> str:
        """Which tiers hold the last snapshot taken for a durable tier in this fit (from the results so far)."""
        step = self.last_durable_due
        held = [f"{t.tier} {t.url}" for i, t in enumerate(self.tiers) if self.committed.get(i, -1) >= (step or 0)]
        return f"step {step} is held by {', '.join(held)}" if held else f"no tier holds step {step} yet"

    def check_durable(self, comm: Comm) -> None:
        """End of fit (collective): the last snapshot taken in this fit must be held by some durable tier; if it is
        not, raise :class:`NotDurableError` (``on_error="raise"``) or log an error (``"warn"``), naming each durable
        tier and why it does not hold it."""
        step = self.last_durable_due
        durable = [i for i, t in enumerate(self.tiers) if t.durable]
        problem = None
        if step is not None and durable and not any(self.committed.get(i, -1) >= step for i in durable):
            why = "; ".join(
                f"the {self.tiers[i].tier} tier {self.tiers[i].url!r}: "
                + (self.problems.get(i) or f"it was not given step {step}")
                for i in durable
            )
            ram = [t.url for i, t in enumerate(self.tiers) if not t.durable and self.committed.get(i, -1) >= step]
            only = f" Only the memory of the RAM tier holds it ({', '.join(ram)})." if ram else ""
            problem = f"{why}.{only}"
        agreed = agree_on(comm, f"whether step {step} is durable", error=problem)
        if agreed.ok:
            return
        message = agreed.text
        text = (
            f"lightning-snapshot: the last snapshot of this fit (step {step}) is not durable: no durable tier"
            f" holds it. {message} Fix the tier (see the reason), then rerun to resume from the newest snapshot"
            " that is durable"
        )
        if self.on_error == "raise":
            raise NotDurableError(text)
        log.error("%s (on_error='warn': fit returns normally)", text)
        warnings.warn(text, stacklevel=3)
