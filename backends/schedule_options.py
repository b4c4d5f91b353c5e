"""A tier's schedule options, read-only: :class:`ScheduleOptionsView` is a mixin of
:class:`~lightning_snapshot.backends.base.Backend`, which validates the options into
:attr:`~lightning_snapshot.backends.base.Backend.schedule_options` (plain data). The interval in use is the callback's:
``SnapshotCallback``'s configuration builds each tier's schedule from these
(:mod:`lightning_snapshot.schedule.schedules`).
"""

from __future__ import annotations

import datetime as _dt

from lightning_snapshot.schedule.interval import ScheduleOptions

__all__ = ["ScheduleOptionsView"]


class ScheduleOptionsView:
    """The schedule options of a tier (:attr:`schedule_options`, set by its constructor) as attributes."""

    schedule_options: ScheduleOptions

    @property
    def every_n_train_steps(self) -> int | None:
        """The step interval the tier starts with (with ``"auto"``: the first one, which the callback's schedule then
        re-estimates), or None (by time only)."""
        return self.schedule_options.every

    @property
    def auto_every(self) -> bool:
        """Whether ``every_n_train_steps="auto"`` was asked for."""
        return self.schedule_options.auto

    @property
    def train_time_interval(self) -> _dt.timedelta | None:
        return self.schedule_options.time_interval

    @property
    def min_every(self) -> int:
        return self.schedule_options.min_every

    @property
    def max_every(self) -> int | None:
        return self.schedule_options.max_every

    def is_due(self, step: int, seconds_since_last: float | None, steps_since_last: int | None = None) -> bool:
        """Whether a snapshot of ``step`` is due in this tier, by its options (with ``"auto"``: at the first interval;
        a fit decides with its own schedule of the tier, which holds the interval in use).

        Args:
            step: the trainer's ``global_step`` after the optimizer step that just finished.
            seconds_since_last: wall time since this tier's last snapshot (or since training started).
            steps_since_last: optimizer steps since this tier's last snapshot in this fit (or since it started);
                with ``every_n_train_steps="auto"`` the snapshot is due when it reaches the interval.
        """
        options = self.schedule_options
        return options.is_due(step, seconds_since_last, steps_since_last, options.every)
