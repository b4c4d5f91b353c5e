"""Snapshot intervals from the failure rate and the measured cost of a snapshot (``every="auto"``).

Young/Daly: with a mean time between failures ``M`` (of the whole job) and a cost ``C`` per snapshot (training time
lost to it), snapshotting every ``sqrt(2 * C * M)`` seconds of training minimises the expected time lost to
snapshots plus the work redone after failures. :class:`CostMeter` measures ``C`` per tier while training runs:
the wall time of every step taken while a snapshot of the tier is in flight (staged, being written, not yet
committed or failed), minus the time such a step takes when nothing is in flight. That excess holds both the
training-thread stall (staging, hand-off, waiting for the copy) and what background work costs training (copy
threads, writes and checksums competing for cores, memory and PCIe bandwidth). It is re-estimated as training runs
(an exponentially weighted mean over snapshots).

Everything here is pure (no torch, no collectives): the callback's schedule (schedule.py, :class:`FitSchedule`)
feeds it times and decides *when* (at snapshot steps every rank agrees on) and *on which rank* (rank 0, then a
broadcast) the intervals change. Also used by config.py and backends/registry.py (durations, ``"auto"``), the
callback (the default MTBF), and ``lightning-snapshot plan`` (plan.py, simulate.py).

:class:`ScheduleOptions` is a tier's schedule as its constructor was given it (``every_n_train_steps``,
``train_time_interval``, ``min_every``, ``max_every``), validated, and the due rule: plain data that the tier keeps.
The callback's configuration builds each tier's schedule from it
(:class:`~lightning_snapshot.schedule.schedules.TierSchedule`,
which holds the interval in use).
"""

from __future__ import annotations

import datetime as _dt
import math
import re
import statistics
from collections import deque
from dataclasses import dataclass

from lightning_snapshot.errors import ConfigError

__all__ = [
    "AUTO",
    "DEFAULT_EVERY_N_TRAIN_STEPS",
    "DEFAULT_NODE_MTBF_S",
    "FIRST_AUTO_INTERVAL",
    "CostMeter",
    "ScheduleOptions",
    "default_mtbf",
    "parse_duration",
    "young_daly_seconds",
    "young_daly_steps",
]

#: The value of ``every_n_train_steps`` (URL ``every=auto``) that asks for intervals from Young/Daly.
AUTO = "auto"
#: Default mean time between failures of one node: 6000 hours. Meta's Llama 3 report counts 419 unexpected
#: interruptions in 54 days on 16,384 GPUs (2,048 nodes of 8): 3.1 hours for the job, about 6,300 hours per node.
DEFAULT_NODE_MTBF_S = 6000 * 3600.0
#: Steps before the first snapshot of an ``every="auto"`` tier (within ``min_every``/``max_every``): the first
#: snapshot is what measures the cost, and the steps before it measure the step time.
FIRST_AUTO_INTERVAL = 10
#: The step interval of a tier given neither ``every_n_train_steps`` nor ``train_time_interval``.
DEFAULT_EVERY_N_TRAIN_STEPS = 100

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(s|m|h|d)?\s*$")
_UNIT = {None: 1.0, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


def parse_duration(value: object, option: str) -> float:
    """Seconds from a positive number of seconds or a string such as ``"90"``, ``"30m"``, ``"4h"``, ``"2d"``.

    Raises:
        ConfigError: naming ``option``, for anything else (zero, negative, NaN, unknown unit).
    """
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        seconds = float(value)
    elif isinstance(value, str) and (m := _DURATION.match(value)):
        seconds = float(m.group(1)) * _UNIT[m.group(2)]
    else:
        seconds = float("nan")
    if not (math.isfinite(seconds) and seconds > 0):
        raise ConfigError(
            f'{option} must be a positive duration: seconds (14400) or a number with s, m, h or d ("4h"), got {value!r}'
        )
    return seconds


@dataclass(frozen=True)
class ScheduleOptions:
    """A tier's schedule options, validated (see :class:`~lightning_snapshot.backends.base.Backend`). Made by
    :meth:`of`; plain data (the interval in use lives in the fit's schedule, not here)."""

    #: whether ``every_n_train_steps="auto"`` was asked for
    auto: bool
    #: the step interval the tier starts with (``"auto"``: the first one, within the bounds), or None (time only)
    every: int | None
    time_interval: _dt.timedelta | None
    min_every: int
    max_every: int | None

    @classmethod
    def of(
        cls,
        every_n_train_steps: int | str | None = None,
        train_time_interval: _dt.timedelta | float | None = None,
        min_every: int | None = None,
        max_every: int | None = None,
    ) -> ScheduleOptions:
        """Validate a tier's schedule arguments.

        Raises:
            ConfigError: naming the option that is not valid and what it accepts.
        """
        auto = every_n_train_steps == AUTO
        for option, value in (("min_every", min_every), ("max_every", max_every)):
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{option} must be an integer >= 1 (steps) or None, got {value!r}")
            if not auto:
                raise ConfigError(
                    f"{option} bounds the interval of every_n_train_steps='auto' (URL every=auto);"
                    " set every_n_train_steps='auto' or drop it"
                )
        if min_every is not None and max_every is not None and min_every > max_every:
            raise ConfigError(f"min_every ({min_every}) must not be larger than max_every ({max_every})")
        if auto:
            every_n_train_steps = max(min_every or 1, FIRST_AUTO_INTERVAL)
            if max_every is not None:
                every_n_train_steps = min(every_n_train_steps, max_every)
        if every_n_train_steps is not None and (
            isinstance(every_n_train_steps, bool) or not isinstance(every_n_train_steps, int) or every_n_train_steps < 1
        ):
            raise ConfigError(
                f"every_n_train_steps must be an integer >= 1, 'auto' or None, got {every_n_train_steps!r}"
            )
        if train_time_interval is not None:
            if isinstance(train_time_interval, (int, float)) and not isinstance(train_time_interval, bool):
                train_time_interval = _dt.timedelta(seconds=train_time_interval)
            if not isinstance(train_time_interval, _dt.timedelta) or train_time_interval.total_seconds() <= 0:
                raise ConfigError(
                    "train_time_interval must be a positive datetime.timedelta or a number of seconds,"
                    f" got {train_time_interval!r}"
                )
        if every_n_train_steps is None and train_time_interval is None:
            every_n_train_steps = DEFAULT_EVERY_N_TRAIN_STEPS
        return cls(auto, every_n_train_steps, train_time_interval, min_every or 1, max_every)

    def is_due(
        self, step: int, seconds_since_last: float | None, steps_since_last: int | None, every: int | None
    ) -> bool:
        """Whether a snapshot of ``step`` is due with the step interval ``every`` (the one in use)."""
        if self.auto:
            if steps_since_last is not None and steps_since_last >= (every or 1):
                return True
        elif every is not None and step % every == 0:
            return True
        return (
            self.time_interval is not None
            and seconds_since_last is not None
            and seconds_since_last >= self.time_interval.total_seconds()
        )


def default_mtbf(num_nodes: int, node_mtbf: float = DEFAULT_NODE_MTBF_S) -> float:
    """The job's mean time between failures (seconds) when failures of ``num_nodes`` nodes are independent."""
    return node_mtbf / max(1, int(num_nodes))


def young_daly_seconds(cost: float, mtbf: float) -> float:
    """Young/Daly's optimal time between snapshots, ``sqrt(2 * cost * mtbf)`` (seconds; 0 when cost is 0)."""
    if cost < 0 or mtbf <= 0:
        raise ValueError(f"cost must be >= 0 and mtbf > 0, got cost={cost}, mtbf={mtbf}")
    return math.sqrt(2.0 * cost * mtbf)


def young_daly_steps(
    cost: float, mtbf: float, step_seconds: float, min_every: int = 1, max_every: int | None = None
) -> int:
    """Young/Daly's interval in optimizer steps, rounded to the nearest step, within ``[min_every, max_every]``."""
    if step_seconds <= 0:
        return max(1, min_every)
    steps = max(1, round(young_daly_seconds(cost, mtbf) / step_seconds))
    steps = max(steps, min_every)
    return min(steps, max_every) if max_every is not None else steps


class CostMeter:
    """Measures, per tier, the training time one snapshot costs, from step wall times.

    Call order (training thread only, not thread-safe): :meth:`step` once per optimizer step with the step's wall
    time; :meth:`opened` when a snapshot of a tier is staged at the end of a step (its cost counts from the next
    step on); :meth:`closed` when its result (committed or failed) arrived, or when it was dropped unwritten; a
    tier's results arrive in the order its snapshots were opened. The excess of a step taken while snapshots are in
    flight (over the median of recent steps with none) is shared equally among them; a snapshot's share, when it
    closes, is one cost sample.

    Args:
        num_tiers: how many tiers are measured (indices 0..num_tiers-1).
        alpha: weight of a new cost sample in the running mean (0 < alpha <= 1).
        window: how many steps with nothing in flight the baseline step time is the median of.
    """

    def __init__(self, num_tiers: int, alpha: float = 0.3, window: int = 32) -> None:
        self.alpha = alpha
        self._clean: deque[float] = deque(maxlen=window)
        #: per tier: the excess (seconds) accumulated by each of its snapshots in flight, oldest first
        self._flight: list[deque[float]] = [deque() for _ in range(num_tiers)]
        self._cost: list[float | None] = [None] * num_tiers

    @property
    def step_seconds(self) -> float | None:
        """The wall time of a step with no snapshot in flight (median of the recent ones), or None yet."""
        return statistics.median(self._clean) if self._clean else None

    def cost(self, tier: int) -> float | None:
        """The running estimate of tier ``tier``'s cost per snapshot (seconds), or None before its first."""
        return self._cost[tier]

    def in_flight(self, tier: int) -> int:
        """How many snapshots of ``tier`` are being measured."""
        return len(self._flight[tier])

    def step(self, seconds: float) -> None:
        """One optimizer step took ``seconds`` of wall time (snapshot work on the training thread included)."""
        count = sum(len(f) for f in self._flight)
        if not count:
            self._clean.append(seconds)
            return
        base = self.step_seconds
        if base is None:
            return  # nothing to compare with yet (the first snapshot of an "auto" tier comes after some steps)
        share = (seconds - base) / count
        for flight in self._flight:
            for k in range(len(flight)):
                flight[k] += share

    def opened(self, tier: int) -> None:
        """A snapshot of ``tier`` was staged at the end of the step just given to :meth:`step`."""
        self._flight[tier].append(0.0)

    def closed(self, tier: int, measured: bool = True) -> None:
        """The oldest snapshot of ``tier`` in flight finished (``measured``: one cost sample, never below 0) or was
        dropped before it was written (not a sample). Nothing in flight: no effect."""
        if not self._flight[tier]:
            return
        excess = self._flight[tier].popleft()
        if measured:
            self.add_sample(tier, max(0.0, excess))

    def add_sample(self, tier: int, cost: float) -> None:
        """Fold one measured cost (seconds) into the tier's running estimate."""
        old = self._cost[tier]
        self._cost[tier] = cost if old is None else old + self.alpha * (cost - old)
