"""Goodput under failures: a seeded discrete-event simulation of a training job that snapshots and fails.

The events are failures (exponential inter-arrival times with the job's MTBF, or given times), restarts and
restores; between two events the snapshot schedule is followed in closed form. A job does ``work_s`` seconds of
useful training. Each tier snapshots every ``interval_s`` seconds of training since the run (re)started, costs
training ``cost_s`` per snapshot, and holds a snapshot ``persist_s`` after it was taken. A failure loses the work
since the newest snapshot held by a tier that the failure left readable (a failure loses a node with probability
``node_loss``; tiers with ``survives_node_loss=False`` are then unreadable), then costs ``restart_s`` and the
restore time of that tier. Goodput is ``work_s`` (the failure-free wall time without snapshots) over the wall time.

Pure Python (no torch): the ``lightning-snapshot plan`` command (plan.py) and the goodput benchmark's checks
(benchmarks/goodput.py) use it.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, replace

from lightning_snapshot.schedule.interval import young_daly_seconds

__all__ = ["Outcome", "TierModel", "simulate"]


@dataclass(frozen=True)
class TierModel:
    """One tier (or one checkpointing method) as the simulation sees it.

    Attributes:
        name: label in reports.
        cost_s: training time lost per snapshot (stall plus background interference), seconds.
        persist_s: from the snapshot until it can be restored, seconds.
        restore_s: time to restore from it after a restart, seconds.
        interval_s: seconds of training between snapshots; None: Young/Daly, ``sqrt(2 x cost_s x MTBF)``.
        survives_node_loss: whether its snapshots are readable after a failure that lost a node.
    """

    name: str
    cost_s: float
    persist_s: float = 0.0
    restore_s: float = 0.0
    interval_s: float | None = None
    survives_node_loss: bool = True


@dataclass(frozen=True)
class Outcome:
    """What a simulated job spent its wall time on (means over the runs)."""

    goodput: float
    wall_s: float
    failures: float
    lost_work_s: float
    overhead_s: float
    restart_s: float
    restore_s: float
    intervals_s: tuple[float, ...]


#: the least share of failures a tier is planned for, even behind a cheaper tier that survives every failure
MIN_SHARE = 0.01


def _interval(t: TierModel) -> float:
    """A planned tier's interval (seconds); :func:`_intervals` gives every tier one."""
    if t.interval_s is None:
        raise ValueError(f"tier {t.name!r} has no interval: plan the tiers with _intervals first")
    return t.interval_s


def _intervals(tiers: Sequence[TierModel], mtbf_s: float, node_loss: float) -> list[TierModel]:
    """Young/Daly intervals for the tiers without one. A tier is planned for the failures its cheaper tiers do not
    cover (one that does not survive a node loss covers ``1 - node_loss`` of them): MTBF / that share."""
    out = []
    for t in tiers:
        if t.interval_s is None:
            share = 1.0
            for other in tiers:
                if other is not t and (other.cost_s, other.name) < (t.cost_s, t.name):
                    share *= 0.0 if other.survives_node_loss else node_loss
            mtbf = mtbf_s / max(share, MIN_SHARE)
            t = replace(t, interval_s=max(young_daly_seconds(t.cost_s, mtbf), 1e-3))
        out.append(t)
    return out


def _one_run(
    tiers: Sequence[TierModel],
    work_s: float,
    restart_s: float,
    node_loss: float,
    rng: random.Random,
    mtbf_s: float,
    failure_times: Sequence[float] | None,
    start_s: float = 0.0,
    horizon_s: float = math.inf,
) -> tuple[float, int, float, float, float]:
    rate = 1.0 + sum(t.cost_s / _interval(t) for t in tiers)  # wall seconds per second of training
    times = iter(sorted(failure_times)) if failure_times is not None else None

    def next_failure(now: float) -> float:
        if times is None:
            t = now + rng.expovariate(1.0 / mtbf_s)
            return t if t <= horizon_s else math.inf
        for t in times:
            if t > now:
                return t if t <= horizon_s else math.inf
        return math.inf

    wall, done, failures = 0.0, 0.0, 0
    lost = restart_total = restore_total = 0.0
    source_restore = 0.0  # restore time of what holds `done` (0: nothing to restore, a fresh start)
    delay = start_s  # start-up, restart and restore before training (re)starts
    fail = next_failure(0.0)
    while True:
        start = wall + delay
        finish = start + (work_s - done) * rate
        spent = min(delay, min(fail, finish) - wall)  # of the restart and restore before the next event
        if failures or not start_s:
            restart_total += min(spent, restart_s)
            restore_total += max(0.0, spent - restart_s)
        if fail >= finish:
            return finish, failures, lost, restart_total, restore_total
        failures += 1
        if fail > start:
            trained = (fail - start) / rate
            node_lost = rng.random() < node_loss
            best, best_restore = done, source_restore
            for t in tiers:
                if node_lost and not t.survives_node_loss:
                    continue
                every = _interval(t)
                held = math.floor(max(0.0, (fail - start - t.persist_s) / rate) / every) * every
                if held > 0 and (done + held > best or (done + held == best and t.restore_s < best_restore)):
                    best, best_restore = done + held, t.restore_s
            lost += done + trained - best
            done, source_restore = best, best_restore
        # (a failure while restarting: the restart begins again, from the same snapshot)
        wall, fail = fail, next_failure(fail)
        delay = restart_s + source_restore


def simulate(
    tiers: Sequence[TierModel],
    *,
    work_s: float,
    mtbf_s: float,
    restart_s: float,
    node_loss: float = 0.0,
    seed: int = 0,
    runs: int = 8,
    failure_times: Sequence[float] | None = None,
    start_s: float = 0.0,
    horizon_s: float = math.inf,
) -> Outcome:
    """Simulate ``runs`` jobs (seeded) and return the mean outcome.

    Args:
        tiers: the tiers (or checkpoint methods); empty: no snapshots (every failure restarts from the beginning).
        work_s: failure-free, snapshot-free wall time of the job (seconds of training).
        mtbf_s: the job's mean time between failures (seconds). A tier without ``interval_s`` gets Young/Daly's
            with the MTBF of the failures its cheaper tiers do not cover (at least ``MIN_SHARE`` of them).
        restart_s: time from a failure until the restarted job starts restoring (a scheduler's requeue).
        node_loss: probability that a failure loses a node (its memory and its tiers without
            ``survives_node_loss``).
        seed: the seed of failure times and node losses.
        runs: how many jobs to average (1 with ``failure_times``).
        failure_times: absolute wall times of failures instead of random ones (a recorded run's).
        start_s: start-up before training first starts (a failure during it starts the job again after
            ``restart_s``); counted in the wall time, not in the restart or restore time.
        horizon_s: no failure after this wall time (a job whose failures stop: each failure time before it is met by
            a run that lasts past it, whatever its speed).
    """
    tiers = _intervals(tiers, mtbf_s, node_loss)
    rng = random.Random(seed)
    results = [
        _one_run(tiers, work_s, restart_s, node_loss, rng, mtbf_s, failure_times, start_s, horizon_s)
        for _ in range(1 if failure_times is not None else runs)
    ]
    n = len(results)
    wall = sum(r[0] for r in results) / n
    lost = sum(r[2] for r in results) / n
    restarts = sum(r[3] for r in results) / n
    restores = sum(r[4] for r in results) / n
    failures = sum(r[1] for r in results) / n
    overhead = wall - work_s - lost - restarts - restores
    return Outcome(
        goodput=sum(work_s / r[0] for r in results) / n,
        wall_s=wall,
        failures=failures,
        lost_work_s=lost,
        overhead_s=max(0.0, overhead),
        restart_s=restarts,
        restore_s=restores,
        intervals_s=tuple(t.interval_s or 0.0 for t in tiers),
    )
