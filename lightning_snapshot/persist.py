"""The persist thread: writes staged snapshots to their tiers, off the training thread, in order.

Every rank runs one. Under DDP they agree on each commit through a dedicated gloo process group created for this
purpose (never the trainer's main group from a background thread). Results, failures included, go to a queue that
the training thread reads at its next step, so a background failure is never silent.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any

from lightning_snapshot.arena import AsyncStaged, HostArena
from lightning_snapshot.backends.base import Backend
from lightning_snapshot.comm import Comm
from lightning_snapshot.staging import StagedState
from lightning_snapshot.writer import SnapshotJob, apply_retention, write_snapshot

__all__ = ["Persister", "PersistJob", "PersistResult", "GroupComm"]

log = logging.getLogger(__name__)


@dataclass
class PersistJob:
    step: int
    epoch: int
    shared: AsyncStaged | StagedState | None
    private: StagedState
    tiers: list[Backend]


@dataclass
class PersistResult:
    tier: Backend
    step: int
    seconds: float
    nbytes: int
    stage_seconds: float | None = None
    error: BaseException | None = None


class GroupComm:
    """:class:`~lightning_snapshot.comm.Comm` over a dedicated torch.distributed group (used by the persist thread)."""

    def __init__(self, group: Any) -> None:
        import torch.distributed as dist

        self._dist = dist
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)

    def barrier(self) -> None:
        self._dist.barrier(group=self.group)

    def broadcast(self, obj: Any) -> Any:
        box = [obj]
        self._dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]

    def all_true(self, flag: bool) -> bool:
        import torch

        t = torch.tensor([1 if flag else 0], dtype=torch.int32)
        self._dist.all_reduce(t, op=self._dist.ReduceOp.MIN, group=self.group)
        return bool(t.item())


class Persister:
    """One background thread that persists :class:`PersistJob`s in submission order.

    Args:
        comm: collectives for the commit (a :class:`GroupComm` under DDP, ``LocalComm`` otherwise).
        run_id: nonce of this run, part of every object name.
        arena: where staged slots are released once persisted.

    Thread-safety: ``submit``, ``results`` and ``drain`` are called from the training thread only.
    """

    def __init__(self, comm: Comm, run_id: str, arena: HostArena) -> None:
        self.comm = comm
        self.run_id = run_id
        self.arena = arena
        self.results: queue.Queue[PersistResult] = queue.Queue()
        self._jobs: queue.Queue[PersistJob | None] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="lightning-snapshot-persist", daemon=True)
        self._thread.start()

    def submit(self, job: PersistJob) -> None:
        self._jobs.put(job)

    def pending(self) -> int:
        return self._jobs.unfinished_tasks

    def drain(self) -> None:
        """Wait until every submitted job is persisted (or failed)."""
        self._jobs.join()

    def close(self) -> None:
        """Finish the queued jobs, then stop the thread."""
        if self._thread.is_alive():
            self._jobs.put(None)
            self._thread.join()

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            try:
                if job is None:
                    return
                self._persist(job)
            finally:
                self._jobs.task_done()

    def _persist(self, job: PersistJob) -> None:
        staged = job.shared
        prepare = verify = None
        state: StagedState | None
        if isinstance(staged, AsyncStaged):
            state, prepare, verify = staged.state, staged.wait, staged.verify
        else:
            state = staged
        try:
            for tier in job.tiers:
                t0 = time.monotonic()
                try:
                    manifest = write_snapshot(tier, self.comm, SnapshotJob(job.step, job.epoch, state, job.private),
                                              self.run_id, prepare=prepare, before_commit=verify)
                    prepare = None  # the copy is done once, for every tier
                    if self.comm.rank == 0:
                        apply_retention(tier, job.step)
                    stage_s = staged.copy_seconds if isinstance(staged, AsyncStaged) else None
                    self.results.put(PersistResult(tier, job.step, time.monotonic() - t0, manifest.total_bytes,
                                                   stage_s))
                except Exception as e:  # noqa: BLE001 - reported to the training thread
                    log.debug("lightning-snapshot: persisting step %d to %s failed", job.step, tier.url,
                              exc_info=True)
                    self.results.put(PersistResult(tier, job.step, time.monotonic() - t0, 0, None, e))
        finally:
            if isinstance(staged, AsyncStaged):
                self.arena.release(staged.slot)
