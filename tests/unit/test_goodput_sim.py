"""The goodput model predicts runs it was not fitted to (tests/fixtures/goodput_predict.json: the runs of
``python benchmarks/goodput.py --predict`` quoted in docs/benchmarks.md), and the check can fail.

Each run is predicted from the invocation's inputs alone, measured in other runs than the one predicted: the step
time of the failure-free ``none`` runs (made first and last), each method's calibration run (its cost per snapshot:
ours from its cost meter, ``snapshot/<tier>/cost_ms``, the others from their step times; its first and restarted
start-ups; its tail), the restart delay and the MTBF. Of the run itself only what it was given enters: its method,
interval and failure times (the experiment's input). The simulator then decides the work lost at each failure (back
to the newest snapshot), the snapshots' cost and the restarts, including failures that hit a restart.

The accuracy asserted is the one the recording supports (``test_the_recorded_predictions_are_as_accurate_as_the_
recording_supports``): a mean absolute error of at most ``MAE`` (0.05; recorded 0.036), no run off by more than
``WORST`` (0.10; recorded 0.099) and at most ``OUTSIDE`` (2) of the 12 runs off by more than ``TOL`` (0.05; recorded
2: docs/benchmarks.md gives the misses). Each broken variant of the model fails it, the run's tail ignored included.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from lightning_snapshot.schedule.simulate import TierModel, simulate

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import goodput  # noqa: E402

FIXTURE = ROOT / "tests" / "fixtures" / "goodput_predict.json"
#: what the prediction may miss a run by, in goodput (ideal wall / wall), but for ``OUTSIDE`` runs
TOL = 0.05
#: the accuracy the recorded run supports (its figures: mean absolute error 0.036, worst run 0.099, 2 runs of 12
#: outside TOL): see test_the_recorded_predictions_are_as_accurate_as_the_recording_supports
MAE, WORST, OUTSIDE = 0.05, 0.10, 2
#: the model broken on purpose, each way (benchmarks/goodput.py ``predict``)
BROKEN = {
    "interval x2": {"interval_scale": 2.0},  # a wrong interval (twice the one the run was given)
    "interval x0.5": {"interval_scale": 0.5},
    "cost x2": {"cost_scale": 2.0},  # a wrong snapshot cost (twice the calibrated one)
    "cost 0": {"cost_scale": 0.0},  # snapshots free
    "lost work ignored": {"lost_work": False},  # each failure loses nothing (snapshots continuous, same cost per s)
    "tail ignored": {"tail": False},  # the run ends at its last step (no final snapshot, teardown, exit)
}
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


def _outside(errors: list[tuple[dict, float]], tol: float = TOL) -> list[str]:
    return [f"{r['method']} MTBF {r['mtbf_s']:g} seed {r['seed']}: {e:+.3f}" for r, e in errors if abs(e) > tol]


def _inaccuracies(errors: list[tuple[dict, float]]) -> list[str]:
    """How ``errors`` miss the accuracy the recording supports (empty: they meet it)."""
    mae = sum(abs(e) for _, e in errors) / len(errors)
    out = [f"mean absolute error {mae:.3f} > {MAE}"] if mae > MAE else []
    out += [f"off by more than {WORST}: {', '.join(_outside(errors, WORST))}"] if _outside(errors, WORST) else []
    if len(_outside(errors)) > OUTSIDE:
        out.append(f"{len(_outside(errors))} runs off by more than {TOL} (at most {OUTSIDE}): {_outside(errors)}")
    return out


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


def test_the_recorded_predictions_are_as_accurate_as_the_recording_supports():
    """Every recorded run, at every MTBF, none left out: the predictions (the model's now, the same as those the
    fixture recorded) miss the measured goodput by 0.05 or less on average, by no more than 0.10 in any run, and by
    more than 0.05 in at most 2 of the 12 runs.

    Why these bounds: they are what the recording meets (mean absolute error 0.036, worst run 0.099, 2 runs outside
    0.05; docs/benchmarks.md). It cannot support 0.05 for every run: the inputs come from other runs, so the
    prediction also misses by what the machine's speed varies between runs (on the VM of the recording two identical
    failure-free runs of one invocation differed by 9%). Each broken model fails them (the test below)."""
    fig = _load()
    errors = _errors(fig)
    for run, error in errors:
        print(
            f"{run['method']:<15} MTBF {run['mtbf_s']:g} seed {run['seed']} failures {run['failures']}"
            f" measured {run['measured_goodput']:.3f} predicted {run['measured_goodput'] + error:.3f}"
        )
        assert run["measured_goodput"] + error == pytest.approx(run["predicted_goodput"], abs=1e-9), run
    assert len(errors) == len(fig["runs"]) == 12
    assert not _inaccuracies(errors), _inaccuracies(errors)


@pytest.mark.parametrize("broken", list(BROKEN.values()), ids=list(BROKEN))
def test_each_broken_model_fails_the_accuracy_check(broken):
    """The accuracy asserted above is not met by the model with any one error, the run's tail ignored included (that
    one moves no run's prediction by more than TOL, but puts 5 runs outside it and one 0.126 off)."""
    found = _inaccuracies(_errors(_load(), **broken))
    print(broken, found)
    assert found


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


@pytest.mark.parametrize("broken", list(BROKEN.values()), ids=list(BROKEN))
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
    late = simulate(
        [tier], work_s=30.0, mtbf_s=100.0, restart_s=5.0, start_s=2.0, failure_times=[20.0, 40.0], horizon_s=30.0
    )
    assert late.wall_s == pytest.approx(47.0) and late.failures == 1
