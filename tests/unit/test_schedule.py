"""The tier schedules as pure units: fixed, time-based and "auto" intervals, their bounds, and one fit's state."""

from __future__ import annotations

import datetime as dt

import pytest

from lightning_snapshot.errors import ConfigError
from lightning_snapshot.schedule.interval import FIRST_AUTO_INTERVAL, young_daly_steps
from lightning_snapshot.schedule.schedules import DEFAULT_EVERY_N_TRAIN_STEPS, FitSchedule, TierSchedule


class _Tier:
    """What FitSchedule reads of a tier: its kind and URL for the log."""

    def __init__(self, url: str = "/snap") -> None:
        self.tier, self.url = "local", url


def _fit(schedules: list[TierSchedule], mtbf: float | None, start_time: float) -> FitSchedule:
    return FitSchedule([_Tier() for _ in schedules], schedules, mtbf=mtbf, start_time=start_time)


def test_a_fixed_interval_is_due_at_its_multiples_only():
    s = TierSchedule(every_n_train_steps=7)
    assert [step for step in range(1, 30) if s.is_due(step, None)] == [7, 14, 21, 28]
    assert s.steps_to_due(7, last_snapshot_step=7) == 0
    assert s.steps_to_due(8, last_snapshot_step=7) == 6
    assert s.retuned(cost=1.0, mtbf=3600.0, step_seconds=0.1) == 7  # (a fixed interval is never retuned)


def test_no_interval_given_means_the_default_steps():
    s = TierSchedule()
    assert s.every == DEFAULT_EVERY_N_TRAIN_STEPS and s.time_interval is None
    assert not s.is_due(DEFAULT_EVERY_N_TRAIN_STEPS - 1, 10**9)
    assert s.is_due(DEFAULT_EVERY_N_TRAIN_STEPS, 0.0)


def test_a_time_interval_alone_is_due_by_wall_time():
    s = TierSchedule(train_time_interval=60)
    assert s.every is None and s.time_interval == dt.timedelta(seconds=60)
    assert not s.is_due(100, 59.9)
    assert s.is_due(7, 60.0)
    assert not s.is_due(7, None)
    assert s.steps_to_due(5, 0) is None


def test_steps_and_time_together_are_due_by_either():
    s = TierSchedule(every_n_train_steps=10, train_time_interval=dt.timedelta(minutes=1))
    assert s.is_due(20, 0.0)
    assert s.is_due(21, 61.0)
    assert not s.is_due(21, 59.0)


def test_auto_starts_at_the_first_interval_within_bounds_and_counts_from_the_last_snapshot():
    s = TierSchedule(every_n_train_steps="auto")
    assert s.auto and s.every == FIRST_AUTO_INTERVAL and (s.min_every, s.max_every) == (1, None)
    assert TierSchedule(every_n_train_steps="auto", min_every=25).every == 25
    assert TierSchedule(every_n_train_steps="auto", max_every=4).every == 4
    # due by steps since its last snapshot, not by multiples of the interval
    assert not s.is_due(15, None, steps_since_last=9)
    assert s.is_due(15, None, steps_since_last=10)
    assert s.steps_to_due(13, last_snapshot_step=5) == 2
    assert s.steps_to_due(30, last_snapshot_step=5) == 0


@pytest.mark.parametrize(
    "cost,mtbf,step_s,bounds",
    [
        (0.5, 3600.0, 0.1, (1, None)),
        (0.5, 3600.0, 0.1, (1, 100)),
        (0.001, 10.0, 1.0, (5, 50)),
        (2.0, 1e6, 0.01, (1, 10_000)),
    ],
)
def test_auto_retunes_by_young_daly_within_its_bounds(cost, mtbf, step_s, bounds):
    s = TierSchedule(every_n_train_steps="auto", min_every=bounds[0], max_every=bounds[1])
    steps = s.retuned(cost, mtbf, step_s)
    assert steps == young_daly_steps(cost, mtbf, step_s, *bounds)
    assert steps >= bounds[0] and (bounds[1] is None or steps <= bounds[1])
    assert s.retuned(None, mtbf, step_s) == s.every  # (nothing measured yet: the interval in use)
    assert s.retuned(cost, mtbf, None) == s.every


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"every_n_train_steps": 0}, "every_n_train_steps must be an integer >= 1, 'auto' or None"),
        ({"every_n_train_steps": True}, "every_n_train_steps must be"),
        ({"every_n_train_steps": "often"}, "every_n_train_steps must be"),
        ({"train_time_interval": -1}, "train_time_interval must be a positive"),
        ({"every_n_train_steps": 5, "min_every": 2}, "min_every bounds the interval of every_n_train_steps='auto'"),
        ({"every_n_train_steps": "auto", "max_every": 0}, "max_every must be an integer >= 1"),
        ({"every_n_train_steps": "auto", "min_every": 9, "max_every": 3}, "min_every (9) must not be larger"),
    ],
)
def test_bad_configuration_names_the_option(kwargs, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        TierSchedule(**kwargs)


def test_a_fit_schedule_counts_each_tier_from_its_own_last_snapshot():
    fixed, auto = TierSchedule(every_n_train_steps=3), TierSchedule(every_n_train_steps="auto", max_every=4)
    fit = _fit([fixed, auto], mtbf=None, start_time=100.0)
    assert fit.meter is None and not fit.time_based
    fit.begin(10)  # (restored at step 10)
    fit.begin(99)  # (only the first call counts)
    assert fit.last_step == [10, 10]
    assert fit.due(12, now=101.0, start_step=0) == [0]  # 12 % 3 == 0; the auto tier: 2 steps < 4
    fit.taken([0], 12, now=101.0)
    assert fit.due(14, now=102.0, start_step=0) == [1]  # 4 steps since step 10
    fit.taken([1], 14, now=102.0)
    assert fit.last_step == [12, 14] and fit.last_time == [101.0, 102.0]
    assert fit.steps_to_due(1, 15) == 3 and fit.steps_to_due(0, 13) == 2


def test_a_time_based_fit_schedule_counts_wall_time_from_the_fit_start():
    fit = _fit([TierSchedule(train_time_interval=30)], mtbf=None, start_time=1000.0)
    assert fit.time_based
    assert fit.due(1, now=1029.0, start_step=0) == []
    assert fit.due(1, now=1030.0, start_step=0) == [0]
    fit.taken([0], 1, now=1030.0)
    assert fit.due(2, now=1040.0, start_step=0) == []


def test_auto_adopts_the_proposal_from_measured_costs_and_reports_it():
    auto = TierSchedule(every_n_train_steps="auto", max_every=1000)
    fit = _fit([auto, TierSchedule(every_n_train_steps=5)], mtbf=3600.0, start_time=0.0)
    assert fit.propose() == [FIRST_AUTO_INTERVAL, 5]  # (nothing measured yet)
    clock = 0.0
    for _ in range(20):  # steps of 0.1 s with nothing in flight
        clock += 0.1
        fit.step_ended(clock)
    fit.opened([0])
    clock += 0.6  # one step with the snapshot in flight: 0.5 s more than usual
    fit.step_ended(clock)
    fit.closed(0, measured=True)
    cost, step_s = fit.meter.cost(0), fit.meter.step_seconds
    assert cost == pytest.approx(0.5, abs=1e-6) and step_s == pytest.approx(0.1, abs=1e-6)
    proposal = fit.propose()
    assert proposal == [young_daly_steps(cost, 3600.0, step_s, 1, 1000), 5]
    metrics = fit.adopt(proposal, rank=0, names=["local0", "local1"])
    assert auto.every == proposal[0]
    assert metrics["snapshot/local0/interval_steps"] == proposal[0]
    assert metrics["snapshot/local0/cost_ms"] == pytest.approx(500, abs=1e-3)
    assert "snapshot/local1/interval_steps" not in metrics  # (a fixed tier is not retuned)
    assert metrics["snapshot/step_ms"] == pytest.approx(100, abs=1e-3)


def test_paused_time_is_not_a_steps_time():
    fit = _fit([TierSchedule(every_n_train_steps="auto")], mtbf=60.0, start_time=0.0)
    for t in (0.0, 1.0, 2.0, 3.0):
        fit.step_ended(t)
    fit.pause(3.2)
    fit.resume(13.2)  # 10 s of validation
    fit.step_ended(14.0)  # the step took 1 s of training
    assert fit.meter.step_seconds == pytest.approx(1.0)


def test_backend_reports_its_schedule_options_read_only_and_holds_no_schedule(tmp_path):
    """A tier keeps its schedule's options as plain data; the callback's configuration builds the schedule, which
    holds the interval in use (re-estimated for "auto") from one fit to the next."""
    from lightning_snapshot import SnapshotCallback
    from lightning_snapshot.backends.local import LocalTier

    tier = LocalTier(tmp_path, every_n_train_steps="auto", min_every=2, max_every=8)
    assert (tier.every_n_train_steps, tier.auto_every, tier.min_every, tier.max_every) == (8, True, 2, 8)
    assert not hasattr(tier, "schedule")
    with pytest.raises(AttributeError):
        tier.every_n_train_steps = 3
    cb = SnapshotCallback(tier)
    (schedule,) = cb.config.schedules
    assert schedule.options is tier.schedule_options and schedule.every == 8
    schedule.every = 6  # what the callback's re-estimation does
    assert tier.every_n_train_steps == 8  # (the tier's options do not change)
    cb.on_error = "warn"  # (a new configuration, same tiers: their schedules carry over)
    assert cb.config.schedules[0] is schedule
