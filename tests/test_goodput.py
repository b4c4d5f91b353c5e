"""benchmarks/goodput.py's supervisor on lightning-snapshot: real SIGKILLs, restarts, an exact final state."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import goodput  # noqa: E402


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
    assert 0 <= run.steps_lost < 45
    assert goodput._bitwise(ideal_dir / "final.pt", d / "final.pt") == "PASS"
