"""Where a node keeps its RAM-tier memory and what names a run: the shared-memory base directory, the memory its
files hold, and the run name derived from the script, the working directory, the tiers and the launcher's job id.

No tier and no I/O beyond the environment and a directory walk: :class:`~lightning_snapshot.backends.ram.tier.RamTier`
(its node directory), the node's snapshot agent (:mod:`~lightning_snapshot.agent`: where its memory is,
how much it holds) and the callback (the default run name) call it.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import sys
from typing import Any

__all__ = ["JOB_ID_VARIABLES", "SHM_ENV", "allocated_bytes", "default_run_name", "default_shm_base", "job_ids"]

#: The environment variable that names the base directory of the nodes' RAM-tier memory.
SHM_ENV = "LIGHTNING_SNAPSHOT_SHM_DIR"


def default_shm_base() -> str:
    """Where nodes keep RAM-tier memory: ``$LIGHTNING_SNAPSHOT_SHM_DIR``, else ``/dev/shm/lightning-snapshot-<uid>``."""
    env = os.environ.get(SHM_ENV)
    if env:
        return env
    base = "/dev/shm" if os.path.isdir("/dev/shm") else os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, f"lightning-snapshot-{os.getuid()}")


def allocated_bytes(path: str | os.PathLike[str]) -> int:
    """Bytes the files under ``path`` occupy (allocated blocks: what shared memory really holds)."""
    total = 0
    for root, _dirs, files in os.walk(path):
        for f in files:
            with contextlib.suppress(OSError):
                total += os.stat(os.path.join(root, f)).st_blocks * 512
    return total


#: Environment variables in which a launcher or scheduler names the job. Each keeps its value when the same job
#: restarts (torchrun's restarts of its workers, a requeued SLURM, LSF or PBS job) and changes for a new job, so a new
#: job never resumes from the RAM snapshots another job left on the node. torchrun's default run id, ``none``, names
#: no job and is ignored.
JOB_ID_VARIABLES = ("TORCHELASTIC_RUN_ID", "SLURM_JOB_ID", "LSB_JOBID", "PBS_JOBID")


def job_ids(environ: Any = None) -> list[str]:
    """``VARIABLE=value`` of each :data:`JOB_ID_VARIABLES` set (to something other than torchrun's ``none``)."""
    env = os.environ if environ is None else environ
    found = []
    for var in JOB_ID_VARIABLES:
        value = str(env.get(var, "")).strip()
        if value and not (var == "TORCHELASTIC_RUN_ID" and value.lower() == "none"):
            found.append(f"{var}={value}")
    return found


def default_run_name(tier_urls: list[str]) -> str:
    """A run name for the agent and memory directory: the same script, working directory, other tiers and launcher
    job id (:data:`JOB_ID_VARIABLES`, where one is set) mean the same run."""
    text = "\n".join(
        [os.getcwd(), os.path.abspath(sys.argv[0]) if sys.argv and sys.argv[0] else "", *tier_urls, *job_ids()]
    )
    return "run-" + hashlib.sha256(text.encode()).hexdigest()[:16]
