"""The goodput model predicts runs it was not fitted to (tests/fixtures/goodput_predict.json: the runs of
``python benchmarks/goodput.py --predict`` quoted in docs/benchmarks.md), and the check can fail.

Each run is predicted from the invocation's inputs alone, measured in other runs than the one predicted: the step
time of the failure-free ``none`` runs (made first and last), each method's calibration run (its cost per snapshot:
ours from its cost meter, ``snapshot/<tier>/cost_ms``, the others from their step times; its first and restarted
start-ups; its tail), the restart delay and the MTBF. Of the run itself only what it was given enters: its method,
interval and failure times (the experiment's input). The simulator then decides the work lost at each failure (back
to the newest snapshot), the snapshots' cost and the restarts, including failures that hit a restart.

The tolerance, ``TOL`` in goodput: see ``test_every_recorded_run_is_predicted_within_the_tolerance``, which the
recorded run does not meet (2 of its 12 runs miss; docs/benchmarks.md gives the misses).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from lightning_snapshot.simulate import TierModel, simulate

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import goodput  # noqa: E402

FIXTURE = ROOT / "tests" / "fixtures" / "goodput_predict.json"
#: what the prediction may miss by, in goodput (ideal wall / wall); justified in the test below
TOL = 0.05
#: what a run's prediction is given of the run itself: what the experiment gave the run, nothing it measured
GIVEN = ("method", "mtbf_s", "every", "failure_schedule")


def _load() -> dict:
    return json.loads(FIXTURE.read_text())


def _errors(fig: dict, **broken: object) -> list[tuple[dict, float]]:
    """(run, predicted - measured goodput) of every recorded run, the model broken as ``broken`` says."""
    out = []
    for run in fig["runs"]:
        given = {k: run[k] for k in GIVEN}
        out.append((run, goodput.predict(fig["inputs"], given, **broken)["goodput"] - run["measured_goodput"]))
    return out


def _outside(errors: list[tuple[dict, float]]) -> list[str]:
    return [f"{r['method']} MTBF {r['mtbf_s']:g} seed {r['seed']}: {e:+.3f}" for r, e in errors if abs(e) > TOL]


def test_the_fixture_holds_runs_not_fitted_to():
    fig = _load()
    inputs, runs = fig["inputs"], fig["runs"]
    # at least 2 MTBFs, each method at each, failures to account for at each
    mtbfs = sorted({r["mtbf_s"] for r in runs})
    assert len(mtbfs) >= 2
    methods = {r["method"] for r in runs}
    assert {"ours-local", "mc-default"} <= methods
    for m in mtbfs:
        assert {r["method"] for r in runs if r["mtbf_s"] == m} == methods
        assert sum(r["failures"] for r in runs if r["mtbf_s"] == m) >= len(methods)
    # the inputs: none's two failure-free runs and one calibration run per method (measured apart from the runs)
    assert len(inputs["none_step_s"]) == 2 and set(inputs["methods"]) == methods
    for cal in inputs["methods"].values():
        assert all(c > 0 for c in cal["costs_s"]) and cal["start_s"] > 0 and cal["restart_start_s"] > 0


@pytest.mark.xfail(strict=True, reason="the recorded run (quiet VM, its speed drifted 9% between the two identical"
                   " failure-free runs) has 10 of 12 runs within 0.05, the worst 0.099 off: see docs/benchmarks.md;"
                   " strict: a recording that passes fails this")
def test_every_recorded_run_is_predicted_within_the_tolerance():
    """Every recorded run, at every MTBF, none left out, is predicted within TOL = 0.05 of its measured goodput.

    Why 0.05: it is below what each error below moves a prediction by. The inputs come from other runs, so the
    prediction also misses by what the machine's speed varies between runs: on the VM of the recording two identical
    failure-free runs of one invocation differed by 9%, and the recording misses by more than 0.05 on 2 of its 12
    runs (docs/benchmarks.md): xfail, strict."""
    errors = _errors(_load())
    for run, error in errors:
        print(f"{run['method']:<15} MTBF {run['mtbf_s']:g} seed {run['seed']} failures {run['failures']}"
              f" measured {run['measured_goodput']:.3f} predicted {run['measured_goodput'] + error:.3f}")
    assert not _outside(errors), _outside(errors)


@pytest.mark.parametrize(
    "broken",
    [
        {"interval_scale": 2.0},  # a wrong interval (twice the one the run was given)
        {"cost_scale": 2.0},  # a wrong snapshot cost (twice the calibrated one)
        {"cost_scale": 0.0},  # snapshots free
        {"lost_work": False},  # each failure loses nothing (snapshots continuous, the same cost per second)
    ],
    ids=["interval x2", "cost x2", "cost 0", "lost work ignored"],
)
def test_each_error_moves_a_prediction_by_more_than_the_tolerance(broken):
    """The regime makes each factor matter: on the same recorded runs, each error moves some run's prediction by more
    than TOL (so a model within TOL of the runs would be put outside it by any of them)."""
    right = [e for _, e in _errors(_load())]
    moves = [w - r for w, r in zip([e for _, e in _errors(_load(), **broken)], right, strict=True)]
    print(broken, [f"{m:+.3f}" for m in moves])
    assert max(abs(m) for m in moves) > TOL, moves


@pytest.mark.parametrize(
    "broken",
    [{"interval_scale": 2.0}, {"interval_scale": 0.5}, {"cost_scale": 2.0}, {"cost_scale": 0.0}, {"lost_work": False}],
    ids=["interval x2", "interval x0.5", "cost x2", "cost 0", "lost work ignored"],
)
def test_the_model_fits_the_recorded_runs_better_than_any_broken_one(broken):
    """On the recorded runs the model as it is misses by less, on average and in runs outside TOL, than the same
    model with any one error (the recording before this one could not tell: there the interval doubled missed by
    less)."""
    right = [abs(e) for _, e in _errors(_load())]
    wrong = [abs(e) for _, e in _errors(_load(), **broken)]
    assert sum(right) < sum(wrong), (sum(right) / len(right), sum(wrong) / len(wrong))
    assert sum(e > TOL for e in right) < sum(e > TOL for e in wrong)


def test_the_simulator_accounts_for_lost_work_snapshot_cost_and_restarts():
    """One failure, worked by hand: 2 s start-up, snapshots every 10 s of training costing 1 s each (training runs
    at 1/1.1 of the wall), a failure at 20 s (16.36 s trained: the snapshot of 10 s is held, 6.36 s lost), a restart
    of 5 s, the 20 s left at the same rate (22 s): done at 47 s."""
    tier = TierModel("t", cost_s=1.0, interval_s=10.0)
    out = simulate([tier], work_s=30.0, mtbf_s=100.0, restart_s=5.0, start_s=2.0, failure_times=[20.0])
    assert out.wall_s == pytest.approx(47.0)
    assert out.lost_work_s == pytest.approx(18 / 1.1 - 10)
    assert out.failures == 1
    # a failure during the restart starts it again (23 s: training resumes at 28 s, done at 50 s)
    again = simulate([tier], work_s=30.0, mtbf_s=100.0, restart_s=5.0, start_s=2.0, failure_times=[20.0, 23.0])
    assert again.wall_s == pytest.approx(50.0) and again.failures == 2
    # a failure after the horizon is not met
    late = simulate([tier], work_s=30.0, mtbf_s=100.0, restart_s=5.0, start_s=2.0, failure_times=[20.0, 40.0],
                    horizon_s=30.0)
    assert late.wall_s == pytest.approx(47.0) and late.failures == 1
