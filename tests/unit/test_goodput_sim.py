"""The simulator replays runs of benchmarks/goodput.py (figures it recorded on the 2-core CI-class machine): the
simulated goodput is within 0.03 of the measured one for each method."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lightning_snapshot.simulate import TierModel, simulate

FIXTURE = Path(__file__).resolve().parent.parent / "fixtures" / "goodput_quick.json"


def replay(fig: dict, run: dict) -> float:
    """Simulated goodput of one recorded run: same failure times, measured costs, start-up and restart times."""
    start = run["first_start_s"]
    tiers = [] if run["method"] == "none" else [
        TierModel(run["method"], cost_s=run["cost_s"], interval_s=run["interval_steps"] * fig["step_s"])]
    out = simulate(tiers, work_s=fig["steps"] * fig["step_s"], mtbf_s=run["mtbf_s"],
                   restart_s=run["restart_attempt_s"], failure_times=[max(0.0, t - start)
                                                                      for t in run["failure_times"]])
    return fig["ideal_wall_s"] / (start + out.wall_s)


def test_simulator_agrees_with_measured_goodput():
    fig = json.loads(FIXTURE.read_text())
    assert {r["method"] for r in fig["runs"]} >= {"none", "mc-yd", "ours-local"}
    for run in fig["runs"]:
        simulated = replay(fig, run)
        print(f"{run['method']:<15} measured {run['measured_goodput']:.3f} simulated {simulated:.3f}")
        assert simulated == pytest.approx(run["measured_goodput"], abs=0.03), run["method"]
