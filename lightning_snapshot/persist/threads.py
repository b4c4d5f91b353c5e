"""Persist threads: write staged snapshots to their tiers, off the training thread.

:class:`Persister` is made by the fit's session (session.py) and fed by the snapshot pipeline (pipeline.py), which
hands it each finished snapshot; its threads write through writer.py (or hand the snapshot to the node's agent, a
:class:`~lightning_snapshot.backends.base.NodeAgent`, when a tier hosts one: the RAM tier).

One thread per tier and rank, so a slow or unreachable tier (an object store during an outage) never holds up the
others. Under DDP the ranks agree on each commit through a gloo process group per tier, created for this purpose
(never the trainer's main group from a background thread). A tier that snapshots the same step as a local tier
uploads the local tier's committed files, byte for byte, so the staging buffer is free as soon as the local tier is
done (promotion is a byte copy: ``docs/format.md``, one format in every tier). Results go to a queue the training
thread reads at its next step.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, field

import tenacity

from lightning_snapshot.backends.base import Backend, NodeAgent
from lightning_snapshot.dist.agree import agree_on
from lightning_snapshot.dist.comm import Comm
from lightning_snapshot.dist.forksafe import first_use
from lightning_snapshot.errors import SnapshotError, SnapshotWriteError
from lightning_snapshot.format.manifest import Manifest
from lightning_snapshot.persist.writer import SnapshotJob, apply_retention, copy_snapshot, write_snapshot
from lightning_snapshot.staging import StagedState
from lightning_snapshot.staging.arena import AsyncStaged, HostArena
from lightning_snapshot.staging.slot import ArenaSlot

__all__ = ["PersistJob", "PersistResult", "Persister"]

log = logging.getLogger(__name__)


@dataclass
class PersistJob:
    step: int
    epoch: int
    shared: AsyncStaged | StagedState | None
    private: StagedState
    tiers: list[Backend]
    done: dict[int, threading.Event] = field(default_factory=dict)
    ok: dict[int, bool] = field(default_factory=dict)
    refs: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)
    #: tier index -> the local tier whose committed copy of this step it uploads (pinned there until it is done)
    sources: dict[int, int] = field(default_factory=dict)
    #: tier indices that no longer hold the staging buffer (each drops its reference once: :meth:`Persister.unref`)
    released: set[int] = field(default_factory=set)
    #: the replica check's outcome (the manifest's ``replicas``:
    #: :meth:`~lightning_snapshot.fit.replicas.Verdict.record`)
    #: or None (not checked)
    replicas: dict | None = None
    #: whether the nodes' snapshot agents may write its durable tiers: every rank's link to its agent worked when it
    #: was handed over (the ranks agree on it; one writing through its agent, another itself, would wait for each
    #: other's parts in vain)
    by_agent: bool = True

    # (what a node agent reads of a job: the typed AgentJob protocol of backends/base.py)
    @property
    def slot(self) -> ArenaSlot | None:
        """The arena slot the shared state is staged in, or None (not staged in the arena)."""
        return self.shared.slot if isinstance(self.shared, AsyncStaged) else None

    @property
    def shared_state(self) -> StagedState | None:
        return self.shared.state if isinstance(self.shared, AsyncStaged) else self.shared


@dataclass
class PersistResult:
    tier: Backend
    step: int
    seconds: float
    nbytes: int
    stage_seconds: float | None = None
    error: BaseException | None = None
    #: True when the upload was given up at the end of training (drain_timeout) during an outage: not a failure of
    #: the snapshot, which the faster tiers hold, but worth a warning.
    abandoned: bool = False


def _retryable(e: BaseException) -> bool:
    return isinstance(e, (OSError, SnapshotWriteError)) and "already committed" not in str(e)


class _TierWorker:
    def __init__(self, persister: Persister, index: int, tier: Backend, comm: Comm) -> None:
        self.p, self.index, self.tier, self.comm = persister, index, tier, comm
        self.jobs: queue.Queue[PersistJob | None] = queue.Queue()
        self.stop = threading.Event()
        #: retries so far (read by the training thread for the ``retries`` metric) and when the current outage
        #: began (None: the tier works), both written by this worker's thread only
        self.retries = 0
        self.outage_since: float | None = None
        self.last_error: str | None = None
        #: Set after an exception in training: the jobs still queued are dropped, not written.
        self.abort = threading.Event()
        #: The step being persisted (None when idle), for the message of a shutdown that cannot wait for it.
        self.current: int | None = None
        self.thread = threading.Thread(target=self._run, name=f"lightning-snapshot-persist-{index}", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while True:
            job = self.jobs.get()
            try:
                if job is None:
                    return
                if self.abort.is_set():
                    self._drop(job)
                    continue
                self.current = job.step
                # (a tier's first write calls operators a first time in the process: forks wait, see forksafe)
                with first_use(f"persist thread of the {self.tier.tier} tier"):
                    self._persist(job)
            finally:
                self.current = None
                self.jobs.task_done()

    def _drop(self, job: PersistJob) -> None:
        """After an exception in training: skip ``job`` (its peers on other ranks drop it too or fail at once)."""
        job.ok[self.index] = False
        job.done[self.index].set()
        if self.index in job.sources:
            self.p.unpin(job.sources[self.index], job.step)
        self.p.unref(job, self.index)

    def _source(self, job: PersistJob) -> int | None:
        """A local tier of the same job whose committed copy this (slower) tier can upload byte for byte."""
        if self.tier.copy_source or not self.tier.durable or self._by_agent(job):
            return None  # (the RAM tier encodes from the staging buffer)
        for i, t in enumerate(self.p.tiers):
            if i != self.index and t.copy_source and i in job.done:
                return i
        return None

    def _by_agent(self, job: PersistJob) -> bool:
        """Whether the node's snapshot agent writes this durable tier (out of this process: no GIL shared)."""
        agent = self.p.agent
        return job.by_agent and agent is not None and self.tier.durable and agent.handles(job, self.tier)

    def _retrying(self, job: PersistJob) -> tenacity.Retrying:
        """How a failed write of ``job`` is retried: with exponential backoff (``retry_initial`` doubling up to
        ``retry_max``) until it succeeds or the worker is stopped, for tiers that declare ``retry_initial`` (object
        stores); never for the others. Under DDP the ranks decide together (they failed together, see
        :func:`~lightning_snapshot.persist.writer.write_snapshot`), so none is left alone in a collective."""
        initial = self.tier.retry_initial
        if not initial:
            return tenacity.Retrying(stop=tenacity.stop_after_attempt(1), reraise=True)
        collective = not self._by_agent(job)  # (the agents agree among themselves; this thread runs no collective)

        def retry(e: BaseException) -> bool:
            want = _retryable(e) and not self.stop.is_set()
            if not collective:
                return want
            (agreed,) = agree_on(self.comm, f"retrying the write to the {self.tier.tier} tier", flags=[want]).flags
            return agreed

        def sleep(seconds: float) -> None:
            self.stop.wait(seconds)  # (a stop ends the wait at once)

        return tenacity.Retrying(
            retry=tenacity.retry_if_exception(retry),
            wait=tenacity.wait_exponential(multiplier=initial, max=self.tier.retry_max),  # type: ignore[arg-type]
            sleep=sleep,
            before_sleep=self._on_retry,
            reraise=True,
        )

    def _on_retry(self, state: tenacity.RetryCallState) -> None:
        """Before each backoff: count the retry; one warning per outage (its first failure)."""
        self.retries += 1
        error = state.outcome.exception() if state.outcome is not None else None
        self.last_error = _describe(self.tier, error) if error is not None else None
        if self.outage_since is None:
            self.outage_since = time.monotonic()
            log.warning(
                "lightning-snapshot: the %s tier %s is failing (%s); retrying with backoff (every %s s,"
                " doubling up to %s s), training goes on (logged once per outage)",
                self.tier.tier,
                self.tier.url,
                _describe(self.tier, error) if error is not None else "?",
                self.tier.retry_initial,
                self.tier.retry_max,
            )
        else:
            log.debug(
                "lightning-snapshot: retry %d of %s in %.1f s: %s",
                self.retries,
                self.tier.url,
                state.upcoming_sleep,
                error,
            )

    def _attempt(self, job: PersistJob, source: int | None) -> tuple[Manifest | None, int] | None:
        """Write ``job`` to this tier once; returns (the committed manifest or None when the agent wrote it, bytes),
        or None when the write was left to the agent because the worker was stopped."""
        staged = job.shared
        if self._by_agent(job):
            assert self.p.agent is not None and isinstance(staged, AsyncStaged)
            staged.wait()
            staged.await_fence(self.stop)
            try:
                nbytes, _ = self.p.agent.persist(job, self.tier, self.stop)
            except TimeoutError:
                return None
            return None, nbytes
        if source is not None:
            return copy_snapshot(self.p.tiers[source], self.tier, job.step, self.comm), 0
        state = staged.state if isinstance(staged, AsyncStaged) else staged
        return write_snapshot(
            self.tier,
            self.comm,
            SnapshotJob(job.step, job.epoch, state, job.private, job.replicas),
            self.p.run_id,
            prepare=staged.wait if isinstance(staged, AsyncStaged) else None,
            before_commit=(lambda: self._settled(staged)) if isinstance(staged, AsyncStaged) else None,
        ), 0

    def _settled(self, staged: AsyncStaged) -> None:
        """Before committing: training has settled that no copied tensor was changed meanwhile, and the staged bytes
        are still the ones of the step."""
        staged.await_fence(self.stop)
        staged.verify()

    def _abandoned(self, job: PersistJob, seconds: float, error: BaseException) -> None:
        self.p.results.put(PersistResult(self.tier, job.step, seconds, 0, error=error, abandoned=True))
        job.ok[self.index] = False

    def _persist(self, job: PersistJob) -> None:
        staged = job.shared
        t0 = time.monotonic()
        try:
            source = job.sources.get(self.index)
            if source is not None:
                job.done[source].wait()
                if job.ok.get(source):
                    self.p.unref(job, self.index)  # (the source's worker has dropped it already)
                else:
                    source = None
            try:
                done = self._retrying(job)(self._attempt, job, source)
            except Exception as e:  # given up: stopped during an outage, or not retryable
                if _retryable(e) and self.tier.retry_initial:
                    self._abandoned(job, time.monotonic() - t0, SnapshotWriteError(_describe(self.tier, e)))
                    return
                raise
            if done is None:
                self._abandoned(job, time.monotonic() - t0, SnapshotWriteError("left to the snapshot agent"))
                return
            manifest, nbytes = done
            if self.outage_since is not None:
                log.info(
                    "lightning-snapshot: the %s tier %s is back after %.0f s",
                    self.tier.tier,
                    self.tier.url,
                    time.monotonic() - self.outage_since,
                )
                self.outage_since = None
            if manifest is None:
                pass  # the agent applied retention
            elif self.comm.rank == 0 or self.tier.node_leader:  # (RAM: each node its own)
                try:
                    apply_retention(self.tier, job.step, pinned=self.p.pinned(self.index), manifest=manifest)
                except Exception as e:  # noqa: BLE001 - the snapshot is committed; cleanup waits for the next one
                    log.warning(
                        "lightning-snapshot: retention in the %s tier %s failed: %s",
                        self.tier.tier,
                        self.tier.url,
                        _describe(self.tier, e),
                    )
            job.ok[self.index] = True
            self.p.newest[self.index] = max(job.step, self.p.newest.get(self.index, -1))
            stage_s = staged.copy_seconds if isinstance(staged, AsyncStaged) else None
            self.p.results.put(
                PersistResult(
                    self.tier,
                    job.step,
                    time.monotonic() - t0,
                    manifest.total_bytes if manifest is not None else nbytes,
                    stage_s,
                )
            )
        except Exception as e:  # reported to the training thread
            job.ok[self.index] = False
            log.debug("lightning-snapshot: persisting step %d to %s failed", job.step, self.tier.url, exc_info=True)
            if not isinstance(e, SnapshotError):
                e = SnapshotWriteError(_describe(self.tier, e))
            self.p.results.put(PersistResult(self.tier, job.step, time.monotonic() - t0, 0, None, e))
        finally:
            job.done[self.index].set()
            if self.index in job.sources:
                self.p.unpin(job.sources[self.index], job.step)
            self.p.unref(job, self.index)
            if job.ok.get(self.index):
                # the tiers that upload this step from this tier's copy no longer need the staging buffer: drop
                # their references now, not when their workers get to the job (a slow or failing tier with a queue
                # of jobs would otherwise hold every staging buffer, and training would wait for its outage to end)
                for i, source in job.sources.items():
                    if source == self.index:
                        self.p.unref(job, i)


def _describe(tier: Backend, e: BaseException) -> str:
    text = f"{type(e).__name__}: {e}" if not isinstance(e, SnapshotError) else str(e)
    return tier.redact(text)


class Persister:
    """Persist threads for a list of tiers.

    Args:
        tiers: the callback's tiers; a worker thread each.
        comms: one collective channel per tier (a :class:`GroupComm` under DDP, ``LocalComm`` otherwise).
        run_id: nonce of this run, part of every object name.
        arena: where a staged slot is released once every tier that took the snapshot is done with it.

    Thread-safety: ``pending``, ``submit``, ``drain`` and ``close`` are called from the training thread only.
    """

    def __init__(
        self, tiers: list[Backend], comms: list[Comm], run_id: str, arena: HostArena, agent: NodeAgent | None = None
    ) -> None:
        self.tiers = tiers
        self.run_id = run_id
        self.arena = arena
        self.agent = agent
        self.results: queue.Queue[PersistResult] = queue.Queue()
        #: per tier index, the newest step it committed in this fit (written by its worker; read from any thread)
        self.newest: dict[int, int] = {}
        self._workers = [_TierWorker(self, i, t, c) for i, (t, c) in enumerate(zip(tiers, comms, strict=True))]
        # steps a slower tier still uploads from a local tier's committed copy: that tier's retention keeps them
        self._pins: dict[int, dict[int, int]] = {}
        self._pin_lock = threading.Lock()
        # tells the node's snapshot agent about each staged snapshot once its copy finished, and about its release,
        # in that order (the agent flushes what is not released if this process dies)
        self._notes: queue.Queue[tuple[str, PersistJob] | None] = queue.Queue()
        self._closing = threading.Event()
        self._notifier: threading.Thread | None = None
        if agent is not None:
            self._notifier = threading.Thread(target=self._notify, name="lightning-snapshot-agent-link", daemon=True)
            self._notifier.start()

    def _notify(self) -> None:
        assert self.agent is not None
        while True:
            item = self._notes.get()
            if item is None:
                return
            what, job = item
            try:
                with first_use("agent link"):
                    if what == "staged":
                        if isinstance(job.shared, AsyncStaged):
                            # the agent holds the snapshot as soon as its bytes are in the slot (it would take the
                            # checksums itself, were this trainer to die now), and gets them once they are taken
                            job.shared.wait_copied()
                            # (not before training settled that the copy is not torn: the agent would flush it)
                            job.shared.await_fence(self._closing)
                            if not job.shared.done():
                                self.agent.staged(job)
                            job.shared.wait()
                        self.agent.staged(job)
                    elif isinstance(job.shared, AsyncStaged):
                        self.agent.release(job.shared.slot, ok=all(job.ok.get(i, False) for i in job.done))
            except Exception as e:  # noqa: BLE001 - a failed copy is reported by the tier workers
                log.debug("lightning-snapshot: agent link: %s", e)

    def pending(self, index: int) -> int:
        """Snapshots queued or being written for tier ``index``."""
        return self._workers[index].jobs.unfinished_tasks

    def retries(self, index: int) -> int:
        """Failed writes of tier ``index`` retried so far (0 for tiers that do not retry)."""
        return self._workers[index].retries

    def last_error(self, index: int) -> str | None:
        """The error of the last failed write of tier ``index`` that was retried (credentials redacted), or None."""
        return self._workers[index].last_error

    def has_room(self, index: int) -> bool:
        limit = self.tiers[index].max_pending
        return limit is None or self.pending(index) < limit

    def submit(self, job: PersistJob, indices: list[int]) -> None:
        """Hand ``job`` to the workers of the tiers ``indices`` (all ranks pass the same indices)."""
        if not indices:
            self._release(job)
            return
        job.refs = len(indices)
        for i in indices:
            job.done[i] = threading.Event()
        for i in indices:
            source = self._workers[i]._source(job)
            if source is not None:
                job.sources[i] = source
                with self._pin_lock:
                    steps = self._pins.setdefault(source, {})
                    steps[job.step] = steps.get(job.step, 0) + 1
        if self._notifier is not None:
            self._notes.put(("staged", job))
        for i in indices:
            self._workers[i].jobs.put(job)

    def pinned(self, index: int) -> set[int]:
        """Steps of tier ``index`` that another tier still uploads from (its retention must keep them)."""
        with self._pin_lock:
            return set(self._pins.get(index, ()))

    def unpin(self, index: int, step: int) -> None:
        with self._pin_lock:
            steps = self._pins.get(index, {})
            steps[step] -= 1
            if not steps[step]:
                del steps[step]

    def unref(self, job: PersistJob, index: int) -> None:
        """Tier ``index`` no longer needs ``job``'s staging buffer (idempotent); the last one releases it."""
        with job.lock:
            if index in job.released:
                return
            job.released.add(index)
            job.refs -= 1
            last = job.refs == 0
        if last:
            self._release(job)

    def _release(self, job: PersistJob) -> None:
        if isinstance(job.shared, AsyncStaged):
            if self._notifier is not None:
                self._notes.put(("release", job))
            self.arena.release(job.shared.slot)

    def drain(self, timeout: float | None = None) -> list[Backend]:
        """Wait for the queued snapshots; tiers with a ``drain_timeout`` are waited for that long at most.

        Returns the tiers still busy when their wait ran out (their retries are stopped).
        """
        late = []
        for w in self._workers:
            limit = w.tier.drain_timeout if timeout is None else timeout
            deadline = None if limit is None else time.monotonic() + limit
            while w.jobs.unfinished_tasks and (deadline is None or time.monotonic() < deadline):
                time.sleep(0.01)
            if w.jobs.unfinished_tasks:
                w.stop.set()
                late.append(w.tier)
        return late

    def wait_idle(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds until no tier has a snapshot queued or being written, stopping nothing
        (any thread: the preemption's watchdog); whether they all finished."""
        deadline = time.monotonic() + timeout
        while any(w.jobs.unfinished_tasks for w in self._workers):
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.01)
        return True

    def close(self, timeout: float = 30.0, abort: bool = False) -> list[str]:
        """Stop every worker after what it has queued, waiting ``timeout`` seconds at most in all.

        Retries of unreachable tiers stop. ``abort`` (after an exception in training): queued snapshots are dropped
        and a write waiting for the snapshot agent's answer is left to the agent. A worker still busy when the time is
        up (a collective waiting for a stuck peer) is left behind (a daemon thread, ended by the peer's failure or the
        group's ``collective_timeout``) and logged as an error naming the rank, the tier and the step.

        Returns those messages (empty when every worker finished).
        """
        deadline = time.monotonic() + timeout
        self._closing.set()
        for w in self._workers:
            if abort:
                w.abort.set()
                w.stop.set()
            elif w.jobs.unfinished_tasks and w.tier.retry_initial:
                w.stop.set()
            w.jobs.put(None)
        late = []
        for w in self._workers:
            w.thread.join(timeout=max(0.0, deadline - time.monotonic()))
            if w.thread.is_alive():
                rank = getattr(w.comm, "rank", 0)
                late.append(
                    f"rank {rank}: the persist thread of the {w.tier.tier} tier {w.tier.url} did not finish"
                    f" step {w.current} within shutdown_timeout={timeout:g} s (waiting for the other ranks or"
                    " the store); left behind"
                )
                log.error("lightning-snapshot: %s", late[-1])
        if self._notifier is not None:
            self._notes.put(None)
            self._notifier.join(timeout=max(0.0, deadline - time.monotonic()))
        return late
