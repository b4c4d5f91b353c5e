"""When each tier snapshots: configuration, decision and state of the schedules, in one place. Pure: no I/O, no
collectives (the caller broadcasts where ranks must agree), clocks passed in.

:class:`TierSchedule` is one tier's: built by the callback's configuration
(:class:`~lightning_snapshot.config.SnapshotConfig`) from the tier's options (``every_n_train_steps``,
``train_time_interval``, ``min_every`` and ``max_every``, which the tier keeps as plain data,
:class:`~lightning_snapshot.schedule.interval.ScheduleOptions`), it holds the interval in use (which
``every_n_train_steps="auto"`` re-estimates) and decides whether a step is due. The tiers themselves hold no
schedule. :class:`FitSchedule` is one fit's,
over all the callback's tiers: the time and step of each tier's last snapshot, the cost meter and the re-estimation
of the ``"auto"`` intervals (Young/Daly, :mod:`lightning_snapshot.schedule.interval`). The callback's snapshot pipeline
asks
it which tiers are due; nothing else decides.
"""

from __future__ import annotations

import datetime as _dt
import itertools
import logging
import statistics
from collections import deque
from collections.abc import Sequence
from typing import Any

from lightning_snapshot.schedule.interval import (
    DEFAULT_EVERY_N_TRAIN_STEPS,
    CostMeter,
    ScheduleOptions,
    young_daly_steps,
)

__all__ = ["DEFAULT_EVERY_N_TRAIN_STEPS", "FitSchedule", "TierSchedule"]

log = logging.getLogger(__name__)


class TierSchedule:
    """One tier's schedule: its options (validated) and the step interval in use, which ``every_n_train_steps="auto"``
    re-estimates (see :class:`~lightning_snapshot.backends.base.Backend` for the options).

    Raises:
        ConfigError: naming the option that is not valid and what it accepts.
    """

    def __init__(
        self,
        every_n_train_steps: int | str | None = None,
        train_time_interval: _dt.timedelta | float | None = None,
        min_every: int | None = None,
        max_every: int | None = None,
    ) -> None:
        self.options = ScheduleOptions.of(every_n_train_steps, train_time_interval, min_every, max_every)
        #: the step interval in use (``"auto"``: the one last re-estimated), or None (time only)
        self.every: int | None = self.options.every

    @classmethod
    def of(cls, options: ScheduleOptions) -> TierSchedule:
        """The schedule of a tier with these options (the configuration builds one per tier from its options)."""
        schedule = cls.__new__(cls)
        schedule.options, schedule.every = options, options.every
        return schedule

    @property
    def auto(self) -> bool:
        return self.options.auto

    @property
    def min_every(self) -> int:
        return self.options.min_every

    @property
    def max_every(self) -> int | None:
        return self.options.max_every

    @property
    def time_interval(self) -> _dt.timedelta | None:
        return self.options.time_interval

    def is_due(self, step: int, seconds_since_last: float | None, steps_since_last: int | None = None) -> bool:
        """Whether a snapshot of ``step`` is due (see :meth:`~lightning_snapshot.backends.base.Backend.is_due`), with
        the interval in use."""
        return self.options.is_due(step, seconds_since_last, steps_since_last, self.every)

    def steps_to_due(self, step: int, last_snapshot_step: int) -> int | None:
        """Optimizer steps from ``step`` until the tier is next due by its step interval (None: it has none)."""
        if self.every is None:
            return None
        if self.auto:
            return max(0, last_snapshot_step + self.every - step)
        return -step % self.every

    def retuned(self, cost: float | None, mtbf: float, step_seconds: float | None) -> int | None:
        """The interval Young/Daly gives an ``"auto"`` tier for a measured cost per snapshot and step time (both
        seconds); the interval in use when either is not measured yet, or for a tier with a fixed interval."""
        if not self.auto or cost is None or step_seconds is None:
            return self.every
        return young_daly_steps(cost, mtbf, step_seconds, self.min_every, self.max_every)


class FitSchedule:
    """The schedules of one fit's tiers, and what they measure (training thread only).

    Args:
        tiers: the callback's tiers, for names in logs.
        schedules: their schedules, in the same order (built by the configuration: the intervals in use carry over
            from one fit of the callback to the next).
        mtbf: the job's mean time between failures (seconds) when some tier is ``"auto"``; None: no tier is.
        start_time: the clock (``time.monotonic``) when the fit starts: every tier's time interval counts from it.
    """

    def __init__(
        self, tiers: Sequence[Any], schedules: Sequence[TierSchedule], mtbf: float | None, start_time: float
    ) -> None:
        self.tiers = list(tiers)
        self.schedules: list[TierSchedule] = list(schedules)
        self.meter = CostMeter(len(self.tiers)) if mtbf is not None else None
        self.mtbf = mtbf or 0.0
        #: per tier: when its last snapshot was taken (the fit's start until then)
        self.last_time = [start_time] * len(self.tiers)
        #: per tier: the step of its last snapshot in this fit; empty until the fit's first optimizer step
        self.last_step: list[int] = []
        #: the interval last logged at INFO, per tier
        self.logged = [s.every or 0 for s in self.schedules]
        self._step_clock: float | None = None
        self._paused = 0.0
        self._ends: deque[float] = deque(maxlen=17)  # when the recent optimizer steps ended
        self._pause_clock: float | None = None

    @property
    def time_based(self) -> bool:
        """Whether some tier is due by wall time (clocks differ across ranks: rank 0's decision must be shared)."""
        return any(s.time_interval is not None for s in self.schedules)

    def begin(self, step: int) -> None:
        """The first optimizer step of the fit ended; ``step`` is the one the fit started from (or restored)."""
        if not self.last_step:
            self.last_step = [step] * len(self.tiers)

    def due(self, step: int, now: float, start_step: int) -> list[int]:
        """The indices of the tiers due at ``step`` (``now``: ``time.monotonic``)."""
        last = self.last_step or [start_step] * len(self.tiers)
        return [i for i, s in enumerate(self.schedules) if s.is_due(step, now - self.last_time[i], step - last[i])]

    def taken(self, indices: Sequence[int], step: int, now: float) -> None:
        """A snapshot of ``step`` is taken for these tiers."""
        for i in indices:
            self.last_time[i] = now
            if self.last_step:
                self.last_step[i] = step

    def steps_to_due(self, index: int, step: int) -> int | None:
        """Optimizer steps from ``step`` until tier ``index`` is next due by its step schedule (None: no such)."""
        last = self.last_step[index] if self.last_step else step
        return self.schedules[index].steps_to_due(step, last)

    # ------------------------------------------------------------------------------------------- every="auto"
    def step_ended(self, now: float) -> None:
        """One optimizer step ended at ``now`` (``time.perf_counter``): its wall time, less pauses, to the meter."""
        self._ends.append(now)
        if self.meter is None:
            return
        if self._step_clock is not None:
            self.meter.step(now - self._step_clock - self._paused)
        self._step_clock, self._paused = now, 0.0

    @property
    def recent_step_seconds(self) -> float | None:
        """The median wall time between the recent optimizer steps (snapshot steps and pauses included), or None
        before three have ended."""
        if len(self._ends) < 3:
            return None
        return statistics.median(b - a for a, b in itertools.pairwise(self._ends))

    def pause(self, now: float) -> None:
        """Time from ``now`` on is not a step's (validation inside training) until :meth:`resume`."""
        self._pause_clock = now

    def resume(self, now: float) -> None:
        if self._pause_clock is not None:
            self._paused += now - self._pause_clock
            self._pause_clock = None

    def opened(self, indices: Sequence[int]) -> None:
        """Snapshots of these tiers are in flight from the next step on (their cost counts)."""
        if self.meter is not None:
            for i in indices:
                self.meter.opened(i)

    def closed(self, index: int, measured: bool) -> None:
        """The snapshot of tier ``index`` opened first ended (``measured``: it was written, its cost counts)."""
        if self.meter is not None:
            self.meter.closed(index, measured=measured)

    def propose(self) -> list[int | None] | None:
        """(Rank 0's is used) the interval of every tier from what was measured; None when no tier is ``"auto"``."""
        if self.meter is None:
            return None
        step_s = self.meter.step_seconds
        return [s.retuned(self.meter.cost(i), self.mtbf, step_s) for i, s in enumerate(self.schedules)]

    def adopt(self, proposal: Sequence[int | None], rank: int, names: Sequence[str]) -> dict[str, float]:
        """Put rank 0's ``proposal`` in use (every rank, at a step every rank snapshots). Returns the metrics of the
        re-estimation (``snapshot/<name>/interval_steps``, ``snapshot/<name>/cost_ms``, ``snapshot/step_ms``, with
        each tier's metric name from ``names``); a large change of an interval is logged at INFO (rank 0)."""
        assert self.meter is not None
        meter = self.meter
        out: dict[str, float] = {}
        for i, (schedule, steps) in enumerate(zip(self.schedules, proposal, strict=True)):
            if not schedule.auto or steps is None:  # (an "auto" tier always has an interval)
                continue
            schedule.every = int(steps)
            out[f"snapshot/{names[i]}/interval_steps"] = schedule.every
            cost = meter.cost(i)
            if cost is not None:
                out[f"snapshot/{names[i]}/cost_ms"] = cost * 1000
            old = self.logged[i] or schedule.every
            if max(old, schedule.every) > 2 * min(old, schedule.every):
                self.logged[i] = schedule.every
                if rank == 0:
                    tier = self.tiers[i]
                    log.info(
                        "lightning-snapshot: the %s tier %s now snapshots every %d steps (was %d): measured"
                        " cost %.1f ms per snapshot, step %.1f ms, MTBF %.0f s",
                        tier.tier,
                        tier.url,
                        schedule.every,
                        old,
                        (meter.cost(i) or 0) * 1000,
                        (meter.step_seconds or 0) * 1000,
                        self.mtbf,
                    )
        if meter.step_seconds is not None:
            out["snapshot/step_ms"] = meter.step_seconds * 1000
        return out
