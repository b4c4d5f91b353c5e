"""The processes of a job, found through /proc: the test scripts signal them as a cluster would, and the tests end a
job that hangs (torchrun starts each rank in a session of its own, so neither the launcher's session nor its process
group holds the ranks)."""

from __future__ import annotations

import os


def job_processes(root: int) -> list[int]:
    """``root`` and all its descendants: for a torchrun job's launcher, the ranks and their loader workers, as
    SLURM's scancel --signal reaches every process of a job step."""
    found, todo = [], [root]
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo.extend(children(pid))
    return found


def children(pid: int) -> list[int]:
    """The direct children of ``pid`` (none once it is gone)."""
    out: list[int] = []
    for task in os.listdir(f"/proc/{pid}/task") if os.path.isdir(f"/proc/{pid}/task") else []:
        try:
            with open(f"/proc/{pid}/task/{task}/children") as f:
                out.extend(int(c) for c in f.read().split())
        except OSError:
            pass
    return out
