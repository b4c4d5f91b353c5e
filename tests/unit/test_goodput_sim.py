"""The simulator replays runs of benchmarks/goodput.py (figures its --json wrote on the 2-core machine): the
simulated goodput is within 0.03 of the measured one for each method.

Each run is replayed with its own figures: its training rate per step (snapshot overhead included: the machine is
shared, so another run's step time is not this run's baseline), its interval, its first start-up and its restart
attempts (delay + start-up + restore), and its failure times; the simulator decides the work lost at each failure
(back to the newest snapshot held) and the failures that hit a restart.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lightning_snapshot.simulate import TierModel, simulate

FIXTURE = Path(__file__).resolve().parent.parent / "fixtures" / "goodput_quick.json"


def replay(fig: dict, run: dict) -> float:
    tiers = [TierModel(run["method"], cost_s=0.0, interval_s=run["interval_steps"] * run["train_step_s"])]
    out = simulate(tiers, work_s=fig["steps"] * run["train_step_s"], mtbf_s=run["mtbf_s"],
                   restart_s=run["restart_attempt_s"], failure_times=run["failure_times"],
                   start_s=run["first_start_s"])
    # after the last step: writing the final state and the exit (the run's own, or as in the ideal run)
    tail = run.get("tail_s", max(0.0, fig["ideal_wall_s"] - fig["first_start_s"] - fig["steps"] * fig["step_s"]))
    return fig["ideal_wall_s"] / (out.wall_s + tail)


def test_simulator_agrees_with_measured_goodput():
    fig = json.loads(FIXTURE.read_text())
    runs = fig["runs"]
    assert {r["method"] for r in runs} >= {"mc-yd", "ours-local"}
    assert sum(r["failures"] for r in runs) >= 1  # the replay has failures to account for
    for run in runs:
        simulated = replay(fig, run)
        print(f"{run['method']:<15} failures {run['failures']} measured {run['measured_goodput']:.3f}"
              f" simulated {simulated:.3f}")
        assert simulated == pytest.approx(run["measured_goodput"], abs=0.03), run["method"]


def test_simulator_agrees_with_the_default_run_at_its_default_mtbf():
    """The default run (W=16000, MTBFs 10/20/40 s, quiet 2-core machine, library at b0ac087): at the default MTBF
    (10 s, 10 to 16 failures per method) every method's replay is within 0.03 of its measured goodput. (At 40 s two
    runs replay 0.057 high: the machine's step rate fell by about half during them, and a replay at the run's mean
    rate puts their one failure at the wrong point of the work; see docs/benchmarks.md.)"""
    fig = json.loads(FIXTURE.with_name("goodput_default.json").read_text())
    runs = [r for r in fig["runs"] if r["mtbf_s"] == 10.0]
    assert {r["method"] for r in runs} == {"mc-yd", "mc-default", "async-io", "dcp", "ours-local", "ours-ram-local"}
    assert min(r["failures"] for r in runs) >= 5
    for run in runs:
        assert replay(fig, run) == pytest.approx(run["measured_goodput"], abs=0.03), run["method"]


def test_simulator_agrees_with_each_methods_mean_over_seeds():
    """The default run with seeds (W=8000, a 128 MiB frozen table, MTBF 12 s under 3 seeds of failure times, 24 and
    48 s under one; quiet 2-core machine, library at 0df1798): per method and MTBF, the mean of the replays is within
    0.03 of the mean measured goodput. (Single runs: 28 of the 30 replay within 0.03; the two that met 9 and 10
    failures replay 0.06-0.07 high: they ended just after a failure time the replay, at the run's mean step rate,
    ends before. See docs/benchmarks.md.)"""
    fig = json.loads(FIXTURE.with_name("goodput_seeds.json").read_text())
    groups: dict[tuple[float, str], list[dict]] = {}
    for run in fig["runs"]:
        groups.setdefault((run["mtbf_s"], run["method"]), []).append(run)
    assert {m for _, m in groups} == {"mc-yd", "mc-default", "async-io", "dcp", "ours-local", "ours-ram-local"}
    assert {len(runs) for (mtbf, _), runs in groups.items() if mtbf == 12.0} == {3}
    assert sum(r["failures"] for r in fig["runs"]) >= 60
    close = 0
    for (mtbf, method), runs in groups.items():
        replays = [replay(fig, r) for r in runs]
        close += sum(abs(s - r["measured_goodput"]) <= 0.03 for s, r in zip(replays, runs, strict=True))
        measured = sum(r["measured_goodput"] for r in runs) / len(runs)
        assert sum(replays) / len(replays) == pytest.approx(measured, abs=0.03), (mtbf, method)
    assert close >= 28
