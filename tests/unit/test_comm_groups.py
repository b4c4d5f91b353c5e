"""The tiers' process groups: a group that cannot form fails within the timeout, naming the tier and what to do."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from conftest import rendezvous_port

SCRIPT = Path(__file__).parent.parent / "scripts" / "group_fail.py"


def test_a_group_that_cannot_form_names_the_tier_and_the_fix_within_the_timeout():
    port = rendezvous_port()
    env = {
        **os.environ,
        "WORLD_SIZE": "2",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "PYTHONWARNINGS": "ignore",
    }
    procs = [
        subprocess.Popen(
            [sys.executable, str(SCRIPT)],
            env={**env, "RANK": str(r)},
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        for r in (0, 1)
    ]
    outs = [p.communicate(timeout=120) for p in procs]  # (gloo's own default would wait 30 minutes)
    said = outs[0][0]
    assert said.startswith(
        "ERROR: rank 0 could not form the process group of the local tier /data/snap within 3 s (collective_timeout)"
    ), outs
    assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in said and "see its log" in said, said
