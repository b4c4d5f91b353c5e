"""benchmarks/goodput.py's supervisor on lightning-snapshot: real SIGKILLs, restarts, an exact final state."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import goodput


@pytest.mark.slow
def test_two_kills_resume_bitwise(tmp_path):
    common = dict(steps=60, restart_delay=0.2, mtbf=3600.0, width=64, workdir=tmp_path, timeout=300)
    ideal, ideal_dir = goodput.run_method("none", every=0, failure_times=[], **common)
    run, d = goodput.run_method("ours-local", every=0, failure_times=[], kill_steps=[25, 45], **common)
    assert ideal.failures == 0 and run.failures == 2
    readies = [r for r in goodput._read_progress(d / "progress.log") if r[0] == "ready"]
    # each restart restored a snapshot (every="auto" starts at 10 steps): not step 0
    assert [r[1] for r in readies][0] == 0 and all(r[1] >= 10 for r in readies[1:]), readies
    assert len(readies) == 3
    # every process's boot (interpreter, torch, Lightning) is measured: not counted as the method's lost time
    assert len(run.boots) == 3 and all(0 < b < 120 for b in run.boots), run.boots
    # steps lost: per kill, from the step the killed process reached back to the step the next one resumed at. The
    # interval is Young/Daly's (it grows past 10 with mtbf=3600), so the bound is what the processes did: each resume
    # is a step the killed process passed, never one before the step that process itself had started from.
    rows = goodput._read_progress(d / "progress.log")
    boots = [i for i, r in enumerate(rows) if r[0] == "boot"] + [len(rows)]
    segments = [rows[boots[i] : boots[i + 1]] for i in range(len(boots) - 1)]
    assert len(segments) == 3, segments
    starts = [[r[1] for r in seg if r[0] == "ready"][-1] for seg in segments]
    reached = [max(r[1] for r in seg if r[0] in ("step", "ready")) for seg in segments]
    assert all(starts[k] <= starts[k + 1] <= reached[k] for k in range(2)), (starts, reached)
    assert reached == [25, 45, 60], reached  # (the worker waits at a kill step until it is killed)
    assert run.steps_lost == sum(reached[k] - starts[k + 1] for k in range(2)) > 0, (run.steps_lost, starts, reached)
    assert goodput._bitwise(ideal_dir / "final.pt", d / "final.pt") == "PASS"


def _run(method: str, seed: int, wall: float, failures: int, bitwise: str | None = None) -> goodput.Run:
    run = goodput.Run(
        method,
        every=10,
        seed=seed,
        wall_s=wall,
        failures=failures,
        boots=[1.0] * (failures + 1),
        starts=[2.0] * (failures + 1),
        train_s=wall / 2,
        steps_trained=1000,
    )
    run.bitwise = bitwise
    return run


def test_targets_are_judged_on_the_means_over_the_seeds():
    """With several seeds, the best method is the one with the best mean goodput, not the best single run: here the
    peer has the best run (seed 1) and ours the best mean."""
    ideal = goodput.Run("none", every=0, wall_s=30.0, boots=[1.0], starts=[2.0], train_s=25.0, steps_trained=1000)
    rows = [
        _run("mc-yd", 0, 100.0, 8),
        _run("ours-ram-local", 0, 50.0, 5, "PASS"),
        _run("mc-yd", 1, 40.0, 2),
        _run("ours-ram-local", 1, 45.0, 3, "PASS"),
    ]
    check = goodput.harness.Targets()
    goodput.targets(ideal, {12.0: rows}, 2.0, 12.0, check)
    text = check.text()
    assert "means over 2 seeds" in text
    best = next(t for t in check.lines if "highest goodput" in t.text)
    # ours: (30/50 + 30/45) / 2 = 0.633; mc-yd: (30/100 + 30/40) / 2 = 0.525
    assert best.status == "PASS" and "ours-ram-local 0.633" in best.text and "mc-yd 0.525" in best.text, best.text
    # lost apart from the restart, mean: ours ((50-30-10-5) + (45-30-6-3)) / 2 = 5.5;
    # mc-yd ((100-30-16-8) + (40-30-4-2)) / 2 = 25: 5.5 <= 25 / 3
    lost = next(t for t in check.lines if "lost time" in t.text)
    assert lost.status == "PASS" and "5.5 s" in lost.text and "25.0 s" in lost.text, lost.text
    # the expected goodput: the prediction from calibrated inputs (here: ours snapshots at a tenth of mc-yd's cost,
    # same start-ups), over draws of failure times, so ours expects more
    cal = {"start_s": 2.0, "restart_start_s": 2.5, "tail_s": 0.5}
    inputs = {
        "steps": 1000,
        "step_s": 0.025,
        "ideal_wall_s": 30.0,
        "restart_delay_s": 2.0,
        "failure_horizon_s": 300.0,
        "methods": {"mc-yd": {**cal, "costs_s": [0.5]}, "ours-ram-local": {**cal, "costs_s": [0.05, 0.05]}},
    }
    expected = {
        (12.0, m): goodput.predict(
            inputs, {"method": m, "mtbf_s": 12.0, "every": 10, "failure_schedule": []}, draws=200
        )["goodput"]
        for m in ("mc-yd", "ours-ram-local")
    }
    table = goodput.summary(ideal, {12.0: rows}, 2.0, expected)
    assert table is not None
    means = {r["method"]: r for r in table.records()}
    assert 0 < means["mc-yd"]["expected_goodput"] < means["ours-ram-local"]["expected_goodput"] <= 1
    assert means["ours-ram-local"]["goodput_mean"] == pytest.approx((30 / 50 + 30 / 45) / 2)
    assert means["ours-ram-local"]["final_state"] == "PASS" and means["mc-yd"]["final_state"] == "-"
    # one seed: no table of means
    assert goodput.summary(ideal, {12.0: rows[:2]}, 2.0, expected) is None
